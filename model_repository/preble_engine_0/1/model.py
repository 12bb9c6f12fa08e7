from preble_backend.engine_server.engine_model import TritonPythonModel  # noqa: F401
