from preble_backend.serving.engine_model import TritonPythonModel  # noqa: F401
