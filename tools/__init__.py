"""Scripts run from the repository root (`python -m tools.gpu_check`); not installed.

A regular package, so that no `tools` package installed elsewhere can shadow it.
"""
