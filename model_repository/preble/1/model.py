from preble_backend.serving.router_model import TritonPythonModel  # noqa: F401
