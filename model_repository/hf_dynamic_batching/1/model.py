# The model lives in the orca_backend package; see orca_backend/baselines/triton_model.py.
from orca_backend.baselines.triton_model import TritonPythonModel  # noqa: F401
