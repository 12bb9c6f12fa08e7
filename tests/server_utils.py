"""Starting real tritonservers for the server tests: free ports, a repository per test
module, and the check that every engine got every KV page back."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from client.triton_client import PrebleClient
from preble_backend.serving.launcher import ServerPorts, free_port, start_server
from preble_backend.serving.repository import write_repository


def fresh_ports() -> ServerPorts:
    return ServerPorts(free_port(), free_port(), free_port())


def launch(repo: Path, log: Path, ready: bool = True, extra_args=None):
    server = start_server(repo, fresh_ports(), log_path=log, extra_args=extra_args)
    if ready:
        server.wait_ready(300)
    return server


def client_for(server) -> PrebleClient:
    return PrebleClient(f"127.0.0.1:{server.ports.http}", f"127.0.0.1:{server.ports.grpc}")


def repository_index(server) -> list[dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.ports.http}/v2/repository/index", data=b"{}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_idle(client: PrebleClient, engine: str, timeout: float = 30) -> dict:
    """Poll an engine until nothing waits or runs; return its load snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.engine_control(engine, "stats")["load"]
        if load["running"] == 0 and load["waiting"] == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def assert_engine_pages_free(client: PrebleClient, engine: str) -> None:
    load = wait_idle(client, engine)
    assert load["running"] == 0 and load["waiting"] == 0, load
    assert load["kv_pages_used"] == load["kv_pages_cached"], load  # nothing private is left
    load = client.engine_control(engine, "flush_cache")["load"]
    assert load["kv_pages_free"] == load["kv_pages_total"], load


def write_test_repository(path: Path, **kw) -> Path:
    kw.setdefault("max_num_tokens", 8192)
    return write_repository(path, **kw)
