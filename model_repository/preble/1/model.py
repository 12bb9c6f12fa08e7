from preble_backend.router.router_model import TritonPythonModel  # noqa: F401
