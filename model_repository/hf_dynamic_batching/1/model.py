# The model lives in the orca_backend package; see orca_backend/triton_hf.py.
from orca_backend.triton_hf import TritonPythonModel  # noqa: F401
