"""Several hosts on one machine: Linux network namespaces stand in for hosts. Each engine
pod (``deploy/entrypoint.py engine``) runs in a namespace of its own behind a veth pair,
with its own address; the router pod runs in this one and names the engines by address,
as the Kubernetes manifests name them by pod DNS name. Under a running load one host's
network is cut: its requests move to the other host and finish, new ones avoid it, and
when its link comes back it takes requests again. Skipped where namespaces cannot be
made (CI runs as root and can)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_utils import Pods, fresh_ports, wait_http_ready

from client.triton_client import PrebleClient

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parent.parent
KEY = "multihost-test-key-0123456789"
GREEDY = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
PROMPT = "Each engine is a host of its own, reached over its own link."


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Host:
    """A network namespace joined to this one by a veth pair: 10.231.<i>.2 inside,
    10.231.<i>.1 here."""

    def __init__(self, i: int) -> None:
        tag = f"{os.getpid() % 10000}{i}"
        self.ns, self.outside, self.inside = f"pb{tag}", f"pbh{tag}", f"pbn{tag}"
        self.address = f"10.231.{i}.2"
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.outside, "type", "veth", "peer", "name", self.inside)
        _ip("link", "set", self.inside, "netns", self.ns)
        _ip("addr", "add", f"10.231.{i}.1/24", "dev", self.outside)
        _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.address}/24", "dev", self.inside)
        for args in (
            ("link", "set", self.outside, "up"),
            ("netns", "exec", self.ns, "ip", "link", "set", self.inside, "up"),
            ("netns", "exec", self.ns, "ip", "link", "set", "lo", "up"),
        ):
            _ip(*args)

    def link(self, up: bool) -> None:
        _ip("link", "set", self.outside, "up" if up else "down")

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


@pytest.fixture
def hosts():
    made = []
    try:
        for i in range(2):
            made.append(Host(i))
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        for host in made:
            host.remove()
        pytest.skip(f"network namespaces cannot be made here: {getattr(err, 'stderr', b'') or err}")
    yield made
    for host in made:
        host.remove()


def test_a_host_whose_network_is_cut_is_routed_around_and_rejoins(hosts, tmp_path, tiny_model):
    pods = Pods(
        tmp_path,
        {
            "PREBLE_MODEL_PATH": tiny_model,
            "PREBLE_API_KEY": KEY,
            "PREBLE_ENGINE_PARAMETERS": json.dumps({"max_num_tokens": 8192}),
        },
    )
    try:
        engines = [  # each namespace has its own ports: the defaults
            pods.start(
                "engine", f"engine{i}", prefix=("ip", "netns", "exec", host.ns), PREBLE_HOST=host.address
            )
            for i, host in enumerate(hosts)
        ]
        for host, process in zip(hosts, engines):
            wait_http_ready(f"http://{host.address}:8000/v2/health/ready", 180, process)
        ports = fresh_ports()
        router = pods.start(
            "router",
            "router",
            ports,
            PREBLE_OPENAI_PORT="0",
            PREBLE_ROUTER_PARAMETERS=json.dumps(
                {"policy": "round_robin", "health_interval_s": 0.5, "health_timeout_s": 3}
            ),
            PREBLE_ENGINES=",".join(
                f"host{i}=grpc://{h.address}:8001/preble_engine_0" for i, h in enumerate(hosts)
            ),
        )
        wait_http_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready", 180, router)
        client = PrebleClient(f"127.0.0.1:{ports.http}", f"127.0.0.1:{ports.grpc}", api_key=KEY)
        expected = client.generate(PROMPT, GREEDY, exclude_input_in_output=True)["text_output"]

        def ask(_):
            return client.generate(PROMPT, GREEDY, exclude_input_in_output=True)

        with ThreadPoolExecutor(6) as pool:
            before = list(pool.map(ask, range(12)))
        assert {a["instance"] for a in before} == {"host0", "host1"}  # round-robin over both hosts
        # Cut host 1's network while requests run on it: they move to host 0 and finish.
        with ThreadPoolExecutor(6) as pool:
            running = [pool.submit(ask, i) for i in range(12)]
            time.sleep(0.3)
            hosts[1].link(up=False)
            started = time.monotonic()
            during = [f.result(timeout=120) for f in running]
        assert time.monotonic() - started < 60  # within the health timeout and a migration, not hung
        assert all(a["text_output"] == expected for a in before + during)  # greedy: the fault-free text
        after = [ask(i) for i in range(6)]
        assert {a["instance"] for a in after} == {"host0"}
        # The link comes back: the monitor sees host 1 answer again and routes to it.
        hosts[1].link(up=True)
        deadline, rejoined = time.monotonic() + 60, set()
        while time.monotonic() < deadline and "host1" not in rejoined:
            rejoined |= {ask(i)["instance"] for i in range(4)}
            time.sleep(0.5)
        assert "host1" in rejoined
        for process, _ in reversed(pods.started):
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
    finally:
        pods.stop()
