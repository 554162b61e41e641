"""Prepare the default model once: `python -m orca_backend.prepare` prints its folder."""
from .model_store import prepare_default_model

if __name__ == "__main__":
    print(prepare_default_model())
