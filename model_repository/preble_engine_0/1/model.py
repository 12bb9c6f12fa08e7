from preble_backend.triton_engine import TritonPythonModel  # noqa: F401
