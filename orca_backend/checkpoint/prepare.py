"""Prepare the default model once: `python -m orca_backend.checkpoint.prepare` prints its folder."""
from .store import prepare_default_model

if __name__ == "__main__":
    print(prepare_default_model())
