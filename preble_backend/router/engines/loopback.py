"""The gRPC endpoint of the tritonserver a model runs in, read from the server's command
line: the router reaches the engines of its own server there (see ``LocalEngine``); and
the check that those local engines are models the router can forward to.

A Python-backend stub is started by ``bash -c "exec stub ..."`` from tritonserver, so the
stub's parent process is the server itself."""

from __future__ import annotations

import os
import re
from pathlib import Path

from preble_backend.common.settings import DEFAULT_PAGE_SIZE
from preble_backend.serving.pbtxt import config_parameter

DEFAULT_GRPC_PORT = 8001  # tritonserver's own default


def grpc_url_from_args(args: list[str]) -> str:
    """``host:port`` a local client reaches the server's gRPC endpoint at, from
    tritonserver's arguments (``--flag=value`` or ``--flag value``)."""
    values: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, eq, value = arg.partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        values[flag] = value
    if values.get("--allow-grpc", "true").lower() in ("false", "0", "off", "no"):
        raise ValueError(
            "tritonserver runs with --allow-grpc=false, but the router reaches the engines of its "
            "own server over gRPC: enable it, or set the router's server_grpc_url"
        )
    port = int(values.get("--grpc-port", DEFAULT_GRPC_PORT))
    host = values.get("--grpc-address", "0.0.0.0")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def server_grpc_url() -> str:
    """This process's tritonserver's gRPC endpoint (called from a model's stub)."""
    cmdline = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    if not args or "tritonserver" not in Path(args[0]).name:
        raise ValueError(
            f"the router's parent process ({args[0] if args else 'gone'}) is not tritonserver: "
            "set the router's server_grpc_url to its server's gRPC endpoint"
        )
    return grpc_url_from_args(args[1:])


def check_local_engines(repository: Path, names: list[str], page_size: int) -> None:
    """Fail the router's load, naming the problem, when a local engine it forwards to is
    not a decoupled model of this repository or pages its KV differently (the router
    matches prompts per page: a different size would never match a prefix)."""
    for name in names:
        config = repository / name / "config.pbtxt"
        if not config.is_file():
            raise ValueError(f"engines: model {name!r} is not in the model repository {repository}")
        text = config.read_text()
        if not re.search(r"model_transaction_policy\s*\{\s*decoupled\s*:\s*true\s*\}", text):
            raise ValueError(f"engines: model {name!r} is not decoupled (model_transaction_policy)")
        theirs = config_parameter(text, "page_size")
        theirs = str(DEFAULT_PAGE_SIZE) if theirs is None else theirs
        if theirs != str(page_size):
            raise ValueError(
                f"page_size={page_size} is invalid: engine {name!r} pages its KV cache by {theirs} tokens"
            )
