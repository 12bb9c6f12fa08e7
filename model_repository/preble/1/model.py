from preble_backend.triton_router import TritonPythonModel  # noqa: F401
