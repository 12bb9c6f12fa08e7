"""``preble serve``: the stack as a service. By default each engine runs in a tritonserver of
its own, supervised and restarted (``runtime/supervisor.py``); the router runs in another,
whose gRPC endpoint clients use; the front serves the OpenAI API and Triton's HTTP API.
Everything listens on loopback unless ``--host`` says otherwise, the admin APIs are behind
a key, and SIGTERM drains: new requests are refused, open ones finish or end with a
message, and the exit code is 0."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from preble_backend.cli.cost_line import announce, engine_facts
from preble_backend.common.keys import ADMIN_KEY_ENV, API_KEY_ENV, ENGINE_KEY_ENV
from preble_backend.common.tenants import KeysFileError, TenantKeys
from preble_backend.common.version import __version__
from preble_backend.model.model_card import ModelCard, model_card
from preble_backend.model.pypi_models import resolve as resolve_model
from preble_backend.model.tiny_model import cache_root
from preble_backend.runtime.access import (
    LOOPBACK,
    Access,
    admin_key_file,
    new_key,
    write_admin_key,
)
from preble_backend.runtime.front_process import OpenAIFront, start_openai_front
from preble_backend.runtime.launcher import (
    LaunchError,
    ServerPorts,
    TritonServer,
    check_port_free,
    free_ports,
)
from preble_backend.runtime.supervisor import Supervised, Supervisor, split_repository
from preble_backend.serving.drain_signal import DRAIN_DIR_ENV, request_drain, wait_drained
from preble_backend.serving.pbtxt import config_parameter


def serve(args: argparse.Namespace) -> int:
    """Run the stack until Ctrl-C or SIGTERM; one clear line on any failure."""
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stop.append(number))
    repository = Path(args.model_repository)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    admin_key = os.environ.get(ADMIN_KEY_ENV) or new_key()
    try:
        tenant_keys = _tenant_keys(args.keys_file, api_key, admin_key)
    except LaunchError as exc:
        print(f"preble serve: {exc}", file=sys.stderr)
        return 1
    if tenant_keys is not None:  # tritonserver's client key is the front's own: no client holds it
        api_key = new_key()
    public = Access(
        host=args.host,
        api_key=api_key,
        admin_key=admin_key,
        http_host=LOOPBACK,
        grpc_host=LOOPBACK,
        metrics_host=LOOPBACK,
    )  # the front serves all three: HTTP re-encoded, gRPC gated, metrics federated
    run_dir = Path(tempfile.mkdtemp(prefix="preble-serve-"))
    log = Path(args.log_file) if args.log_file else run_dir / "tritonserver.log"
    supervisor, front, router = None, None, None
    try:
        if admin_key == api_key:
            raise LaunchError(f"{ADMIN_KEY_ENV} equals the API key: the admin key must be one no client has")
        public_ports = [p for p in (args.http_port, args.grpc_port, args.metrics_port, args.openai_port) if p]
        for port in public_ports:
            check_port_free(port, args.host)
        if not repository.is_dir():
            raise LaunchError(f"model repository {repository} does not exist")
        if not (repository / "preble" / "config.pbtxt").is_file():
            raise LaunchError(f"{repository} holds no router model (preble/config.pbtxt): see `preble repo`")
        engine_key = os.environ.get(ENGINE_KEY_ENV) or new_key()  # remote engine servers may need theirs
        if engine_key == api_key:
            raise LaunchError(f"{ENGINE_KEY_ENV} equals the API key: no client may hold the engine key")
        env = {ENGINE_KEY_ENV: engine_key, ADMIN_KEY_ENV: admin_key, DRAIN_DIR_ENV: str(run_dir)}
        if args.layout == "split":
            router_repo, engines = split_repository(repository, run_dir, public_ports)
            for engine in engines:
                engine.log_path = log.with_suffix(f".{engine.model}.log")
            engine_access = Access(host=LOOPBACK, api_key=engine_key)  # its admin key: nobody's
            supervisor = Supervisor(engines, engine_access, {})
            print(f"preble serve: starting {len(engines)} engine server(s) (logs: {log.parent})", flush=True)
            supervisor.start()
        else:  # engines share the router's server: one crash domain (docs/SECURITY.md)
            router_repo, supervisor = repository, Supervisor([], public, {})
            # local engines are models of the public server (they take the API key); remote
            # ones, as a Kubernetes router pod's, their own key where one is given
            local_key = os.environ.get(ENGINE_KEY_ENV) or api_key or ""
            env = {ENGINE_KEY_ENV: local_key, ADMIN_KEY_ENV: admin_key, DRAIN_DIR_ENV: str(run_dir)}
        if stop:
            return 0
        ports = ServerPorts(*free_ports(3, avoid=public_ports))  # the public ones are the front's
        print(f"preble serve {__version__}: starting tritonserver on {repository} (log: {log})", flush=True)
        router = Supervised(
            "preble", router_repo, ports, log, access=public, env=env, watch_stub=False, role="router",
        )  # fmt: skip
        if not supervisor.add(router, lambda: bool(stop)):
            return 0
        model = served_model(repository)
        front = start_openai_front(
            f"{LOOPBACK}:{ports.grpc}", args.openai_port, model.path, log.with_suffix(".front.log"),
            args.served_model_name or "", server=router.server, http_port=args.http_port, access=public,
            grpc_port=args.grpc_port,
            max_body_bytes=args.max_body_bytes, drain_s=args.drain_timeout, model_name=model.name,
            dtype=model.dtype, metrics_port=args.metrics_port,
            engine_metrics={u.model: f"{LOOPBACK}:{u.ports.metrics}" for u in supervisor.units
                            if u.role == "engine"}, keys_file=args.keys_file,
        )  # fmt: skip
        front.wait_answering()
        print(f"  model    {model.line()}")
        announce_cost_model(repository, model)
        _announce(args, public, front, tenant_keys is not None)
        engines = [unit for unit in supervisor.units if unit.role == "engine"]
        for unit in engines:  # their preble_engine_* series; loopback only, no key needed
            print(f"  {unit.model} metrics http://{LOOPBACK}:{unit.ports.metrics}/metrics")
        if engines:
            targets = write_scrape_targets(args.grpc_port, engines)
            print(f"  engine scrape targets (Prometheus file_sd) in {targets}")
        for line in unreachable_engines(router_repo / "preble" / "config.pbtxt", env[ENGINE_KEY_ENV]):
            print(f"preble serve: warning: {line}", flush=True)
        key_file = write_admin_key(args.grpc_port, admin_key)
        print(f"  admin key (preble bench's policy switches, logging, trace) in {key_file}")
        if not front.healthy():
            print("preble serve: warning: no engine is ready yet (/health answers 503 until one is)")
        print("ready; Ctrl-C to stop", flush=True)
        while not stop:
            supervisor.poll()  # restarts an engine's server, or the router's, that died
            if front.process.poll() is not None:
                print(f"preble serve: the front exited: {front.failure()}", file=sys.stderr)
                return 1
            time.sleep(0.25)
        print("preble serve: draining: new requests are refused, open ones may finish "
              f"(up to {args.drain_timeout:g}s)", flush=True)  # fmt: skip
        return 0
    except LaunchError as exc:
        print(f"preble serve: {exc}", file=sys.stderr)
        return 1
    finally:
        _shutdown(front, router.server if router else None, supervisor, args.drain_timeout, run_dir)
        admin_key_file(args.grpc_port).unlink(missing_ok=True)
        scrape_targets_file(args.grpc_port).unlink(missing_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def scrape_targets_file(grpc_port: int) -> Path:
    """Where ``preble serve`` lists its engine servers' metrics endpoints for Prometheus
    (``docs/grafana/prometheus.yml`` reads these files): their ports are picked at start."""
    return cache_root() / "prometheus" / f"engines-{grpc_port}.json"


def write_scrape_targets(grpc_port: int, engines: list[Supervised]) -> Path:
    path = scrape_targets_file(grpc_port)
    path.parent.mkdir(parents=True, exist_ok=True)
    groups = [{"targets": [f"{LOOPBACK}:{unit.ports.metrics}"], "labels": {"engine": unit.model}}
              for unit in engines]  # fmt: skip
    path.write_text(json.dumps(groups, indent=1))
    return path


def _tenant_keys(path: str | None, api_key: str | None, admin_key: str) -> TenantKeys | None:
    """The keys file, checked before anything starts (a bad line is refused, by number)."""
    if not path:
        return None
    if api_key:
        raise LaunchError("give --keys-file or an API key (--api-key, PREBLE_API_KEY), not both: "
                          "the keys file's keys are the API keys, each naming its tenant")  # fmt: skip
    try:
        keys = TenantKeys.load(path)
    except KeysFileError as exc:
        raise LaunchError(str(exc)) from None
    for name, key in ((ADMIN_KEY_ENV, admin_key), (ENGINE_KEY_ENV, os.environ.get(ENGINE_KEY_ENV))):
        if keys.holds(key):
            raise LaunchError(f"keys file {path} holds {name}: no client may hold that key")
    return keys


def _announce(args: argparse.Namespace, access: Access, front: OpenAIFront, tenants: bool = False) -> None:
    host = access.client_host
    endpoints = {
        "http": f"http://{host}:{args.http_port}",
        "grpc": f"{host}:{args.grpc_port}",
        "metrics": f"http://{host}:{args.metrics_port}/metrics",
    }
    if args.openai_port:
        endpoints["openai"] = front.url
    for kind, url in endpoints.items():
        print(f"  {kind:8s} {url}")
    auth = " -H 'Authorization: Bearer $PREBLE_API_KEY'" if access.api_key else ""
    if tenants:
        auth = " -H 'Authorization: Bearer <a key of the keys file>'"
    print(
        f"  generate: curl {endpoints['http']}/v2/models/preble/generate -H 'Content-Type: application/json'"
        f'{auth} -d \'{{"text_input": "Hello", "sampling_parameters": "{{\\"max_tokens\\": 16}}"}}\''
    )
    if access.host not in (LOOPBACK, "localhost", "::1") and not access.api_key:
        print(f"preble serve: warning: listening on {access.host} with no API key: anyone who reaches "
              "this host can send requests (--api-key or PREBLE_API_KEY)")  # fmt: skip


def _shutdown(front, server: TritonServer | None, supervisor: Supervisor | None, drain_s: float,
              run_dir: Path) -> None:  # fmt: skip
    """The front and the router drain together (``drain_signal.py``): each refuses new
    requests, lets open ones run until the deadline and ends the rest with a message its
    client reads. Then the router's server stops, and the engines last."""
    code = None
    ready = server is not None and server.process.poll() is None and server.is_ready()
    if ready:
        request_drain(run_dir, drain_s)
    if front is not None:
        front.stop(timeout=drain_s + 10)
    if server is not None:
        if ready:
            wait_drained(run_dir, drain_s + 10)
        code = server.stop()
    if supervisor is not None:
        supervisor.stop()
    if code is not None:
        print(f"preble serve: stopped (tritonserver exit code {code})")


def unreachable_engines(router_config: Path, key: str | None, timeout_s: float = 3.0) -> list[str]:
    """Each remote engine of the router that does not answer as ready, and why."""
    import tritonclient.grpc as grpcclient

    from preble_backend.common.keys import grpc_bearer

    entries = (config_parameter(router_config.read_text(), "engines") or "").split(",")
    problems = []
    for entry in (e.strip() for e in entries if "grpc://" in e):
        url, _, model = entry.rpartition("grpc://")[2].partition("/")
        client = grpcclient.InferenceServerClient(url)
        try:
            ready = client.is_model_ready(model, headers=dict(grpc_bearer(key)), client_timeout=timeout_s)
            reason = None if ready else "its model is not ready"
        except Exception as exc:  # unreachable, refused, restricted: each says why
            reason = str(exc).splitlines()[0]
        finally:
            client.close()
        if reason:
            problems.append(f"engine {entry} is unreachable ({reason}); the router routes around it "
                            "until it answers")  # fmt: skip
    return problems


def announce_cost_model(repository: Path, model: ModelCard) -> None:
    """The router's cost model for the first local engine (``cost_line.announce``)."""
    router = repository / "preble" / "config.pbtxt"
    setting = (config_parameter(router.read_text(), "cost_model") if router.is_file() else None) or "auto"
    engine = next(iter(sorted(repository.glob("preble_engine_*/config.pbtxt"))), None)
    if engine is None:
        return announce(setting, None, "preble serve")
    text = engine.read_text()
    get = functools.partial(config_parameter, text)
    tp, slowdown = int(get("tensor_parallel_size") or 1), float(get("emulated_slowdown") or 1)
    compute, fit = get("compute") or "model", get("cost_model") or ""
    facts = engine_facts(model, get("device") or "cpu", tp, compute, fit, slowdown)
    announce(setting, facts, "preble serve")


def served_model(repository: Path) -> ModelCard:
    """The engines' model as the repository's router names it (resolved as the router
    does), with the dtype and device of its first local engine."""
    config = repository / "preble" / "config.pbtxt"
    model_path = (config_parameter(config.read_text(), "model_path") if config.is_file() else None) or "tiny"
    engine = next(iter(sorted(repository.glob("preble_engine_*/config.pbtxt"))), None)
    text = engine.read_text() if engine is not None else ""
    dtype, device = (config_parameter(text, key) for key in ("dtype", "device"))
    resolved = resolve_model(model_path, base=repository)
    return model_card(model_path, resolved, dtype or "auto", device or "cpu")
