#!/usr/bin/env python3
"""The container's entrypoint: one role per pod (``deploy/k8s/preble.yaml``).

    deploy/entrypoint.py engine    # one engine model in a tritonserver of its own
    deploy/entrypoint.py router    # the router and the OpenAI front over the engine pods

The model repository is written at start from the environment, which the manifests fill
from the ``preble`` ConfigMap and the ``preble-api-key`` Secret; an operator tunes the
deployment by editing the ConfigMap, as a single host is tuned by editing config.pbtxt:

    PREBLE_MODEL_PATH          a model directory or a ``preble model`` name (default tiny)
    PREBLE_ENGINE_PARAMETERS   JSON object of engine parameters (``EngineConfig`` keys)
    PREBLE_ROUTER_PARAMETERS   JSON object of router parameters (``RouterConfig`` keys)
    PREBLE_ENGINES             router: ``name=grpc://host:port/model``, comma-separated (or
                               none, where PREBLE_ROUTER_PARAMETERS names ``engines_dns``:
                               the engines' headless Service, so engines join and leave)
    PREBLE_HOST                the address to listen on (default 127.0.0.1; pods: 0.0.0.0)
    PREBLE_API_KEY             router: the key every client must send
    PREBLE_KEYS_FILE           router, instead: a keys file naming each client key's tenant
                               (``preble serve --keys-file``; mount it from a Secret)
    PREBLE_ENGINE_KEY          the key the router sends its engines (an engine pod takes
                               no other): clients never hold it
    PREBLE_ADMIN_KEY           router: the admin key (policy switches, logging, trace);
                               random when unset
    PREBLE_REPOSITORY          where the repository is written (default /tmp/preble-repository)
    PREBLE_HTTP_PORT, PREBLE_GRPC_PORT, PREBLE_METRICS_PORT (8000, 8001, 8002),
    PREBLE_OPENAI_PORT         router only (default 9000; 0: none)

An engine pod takes its one GPU (``KIND_GPU``, device 0: Kubernetes gives it one) or runs
on the CPU where there is none. The router pod runs ``preble serve``, which drains on
SIGTERM; the engine pod stops its server on SIGTERM. CI runs both roles on one host
(``tests/test_deployment.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout as well as from an installed image


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _json(name: str) -> dict:
    text = os.environ.get(name, "").strip()
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as err:
        raise SystemExit(f"entrypoint: {name} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"entrypoint: {name} must be a JSON object of parameters")
    return value


def _repository() -> Path:
    path = Path(_env("PREBLE_REPOSITORY", "/tmp/preble-repository"))
    if path.exists():  # a restarted container writes it afresh from the ConfigMap
        shutil.rmtree(path)
    return path


def engine() -> int:
    import torch

    from preble_backend.runtime.access import Access
    from preble_backend.runtime.launcher import ServerPorts, start_server
    from preble_backend.runtime.repository import write_repository

    gpus = [0] if torch.cuda.is_available() else None
    repo = write_repository(
        _repository(),
        _env("PREBLE_MODEL_PATH", "tiny"),
        gpus=gpus,
        cpu_engines=1,
        with_router=False,
        **_json("PREBLE_ENGINE_PARAMETERS"),
    )
    ports = ServerPorts(
        int(_env("PREBLE_HTTP_PORT", "8000")),
        int(_env("PREBLE_GRPC_PORT", "8001")),
        int(_env("PREBLE_METRICS_PORT", "8002")),
    )
    key = os.environ.get("PREBLE_ENGINE_KEY") or None  # the router's; clients never hold it
    access = Access(host=_env("PREBLE_HOST", "127.0.0.1"), api_key=key)
    server = start_server(repo, ports, log_path="/dev/stdout", access=access)
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stop.append(number))
    print(f"entrypoint: engine on {'cuda:0' if gpus else 'cpu'}, grpc {access.host}:{ports.grpc}", flush=True)
    while not stop and server.process.poll() is None:
        time.sleep(0.2)
    if stop:
        server.stop()
        return 0
    return server.process.returncode or 1  # the server died: the pod restarts


def router() -> int:
    from preble_backend.runtime.repository import write_repository

    engines = [e.strip() for e in _env("PREBLE_ENGINES", "").split(",") if e.strip()]
    page = {k: v for k, v in _json("PREBLE_ENGINE_PARAMETERS").items() if k == "page_size"}
    try:
        repo = write_repository(  # no engines of its own; the router matches prompts in their page size
            _repository(),
            _env("PREBLE_MODEL_PATH", "tiny"),
            cpu_engines=0,
            remote_engines=engines,
            router_overrides=_json("PREBLE_ROUTER_PARAMETERS"),
            **page,
        )
    except (TypeError, ValueError) as err:  # no engines from any source, a bad parameter
        raise SystemExit(f"entrypoint: the router's parameters: {err}") from None
    args = [
        sys.executable,
        "-m",
        "preble_backend.cli",
        "serve",
        "--model-repository",
        str(repo),
        "--layout",
        "single",
        "--host",
        _env("PREBLE_HOST", "127.0.0.1"),
        "--http-port",
        _env("PREBLE_HTTP_PORT", "8000"),
        "--grpc-port",
        _env("PREBLE_GRPC_PORT", "8001"),
        "--metrics-port",
        _env("PREBLE_METRICS_PORT", "8002"),
        "--openai-port",
        _env("PREBLE_OPENAI_PORT", "9000"),
    ]
    if keys := os.environ.get("PREBLE_KEYS_FILE"):  # tenants' keys replace the one API key
        args += ["--keys-file", keys]
        os.environ.pop("PREBLE_API_KEY", None)
    os.chdir(ROOT)
    os.execv(sys.executable, args)  # serve drains on the pod's SIGTERM


if __name__ == "__main__":
    roles = {"engine": engine, "router": router}
    if len(sys.argv) != 2 or sys.argv[1] not in roles:
        raise SystemExit(f"usage: {sys.argv[0]} engine|router")
    raise SystemExit(roles[sys.argv[1]]())
