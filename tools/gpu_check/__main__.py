"""`python -m tools.gpu_check`, from the repository root; see the package docstring."""
import sys

from tools.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
