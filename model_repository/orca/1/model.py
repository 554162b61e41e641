# The model lives in the orca_backend package; see orca_backend/serving/triton_model.py.
from orca_backend.serving.triton_model import TritonPythonModel  # noqa: F401
