"""Several hosts on one machine: Linux network namespaces stand in for hosts. Each engine
pod (``deploy/entrypoint.py engine``) runs in a network namespace of its own behind a veth
pair, with its own address. The router pod runs in this one, with a mount namespace of its
own whose ``/etc/resolv.conf`` names a DNS server the test runs (dnslib): it finds the
engines as a Kubernetes router finds them, by one name resolving to an address per engine
pod (``engines_dns``), while a trace runs. A host is added to the name (new requests reach
it), one is removed (its requests finish, none hang, then its pod stops) and one's network
is cut (its requests move on within the health timeout, and it rejoins when the link is
back); after each change the router's belief of every engine's cache is the engine's own
count. Skipped where namespaces cannot be made (CI runs as root and can)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSServer
from server_utils import Pods, fresh_ports, metric_value, wait_for, wait_http_ready

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
        for i in range(3):
            made.append(Host(i))
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        for host in made:
            host.remove()
        pytest.skip(f"network namespaces cannot be made here: {getattr(err, 'stderr', b'') or err}")
    yield made
    for host in made:
        host.remove()


class Zone(BaseResolver):
    """A DNS server for one name, on a loopback address of its own: A records for the
    addresses listed now (none listed: NXDOMAIN), no AAAA records."""

    def __init__(self, address: str) -> None:
        self.records: dict[str, list[str]] = {}
        self.server = DNSServer(self, port=53, address=address)
        self.server.start_thread()

    def resolve(self, request, handler):
        reply = request.reply()
        addresses = self.records.get(str(request.q.qname).rstrip("."))
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
        return reply


class Trace:
    """Clients asking without pause, each answer kept with its prompt and the moment it
    was asked (an answer that arrives after a change may have been routed before it),
    until ``stop``."""

    def __init__(self, ask, prompts: list[str], workers: int = 4) -> None:
        self.answers: list[tuple[str, dict, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()

        def run(k: int) -> None:
            for i in itertools.count(k):
                if self._stop.is_set():
                    return
                prompt = prompts[i % len(prompts)]
                asked = time.monotonic()
                try:
                    self.answers.append((prompt, ask(prompt), asked))
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")

        self._threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(workers)]
        for thread in self._threads:
            thread.start()

    def served_by(self, since: float = 0.0) -> set[str]:
        """The engines that answered requests asked at ``since`` or later."""
        return {answer["instance"] for _, answer, asked in list(self.answers) if asked >= since}

    def answered(self, since: float) -> int:
        return sum(asked >= since for _, _, asked in list(self.answers))

    def stop(self, expected: dict[str, str]) -> None:
        """Every request answered (none hung), each with its fault-free greedy text."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
            assert not thread.is_alive(), "a request hung"
        assert not self.errors, self.errors
        assert self.answers
        assert all(answer["text_output"] == expected[prompt] for prompt, answer, _ in self.answers)


@pytest.fixture
def zone():
    address = f"127.0.{os.getpid() % 200 + 20}.53"
    try:
        zone = Zone(address)
    except OSError as err:
        pytest.skip(f"no DNS server can listen on {address}:53 here: {err}")
    yield zone
    zone.server.stop()


def test_engines_found_by_dns_join_leave_and_are_routed_around(hosts, zone, tmp_path, tiny_model):
    name = "preble-engines.preble.test"
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {zone.server.server.server_address[0]}\noptions timeout:1 attempts:2\n")
    private_resolver = ("unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"',
                        str(resolv))  # fmt: skip
    pods = Pods(tmp_path, {"PREBLE_MODEL_PATH": tiny_model, "PREBLE_API_KEY": KEY,
                           "PREBLE_ENGINE_PARAMETERS": json.dumps({"max_num_tokens": 8192})})  # fmt: skip
    try:
        engines = [  # each namespace has its own ports: the defaults
            pods.start(
                "engine", f"engine{i}", prefix=("ip", "netns", "exec", host.ns), PREBLE_HOST=host.address
            )
            for i, host in enumerate(hosts)
        ]
        for host, process in zip(hosts, engines):
            wait_http_ready(f"http://{host.address}:8000/v2/health/ready", 180, process)
        engine = {host.address: f"{host.address}:8001" for host in hosts}  # how the router names them
        zone.records[name] = [hosts[0].address, hosts[1].address]
        ports = fresh_ports()
        parameters = {"engines_dns": f"{name}:8001/preble_engine_0", "discovery_interval_s": 0.5,
                      "health_interval_s": 0.5, "health_timeout_s": 3, "leave_timeout_s": 20}  # fmt: skip
        router = pods.start("router", "router", ports, prefix=private_resolver, PREBLE_OPENAI_PORT="0",
                            PREBLE_ENGINES="", PREBLE_ROUTER_PARAMETERS=json.dumps(parameters))  # fmt: skip
        wait_http_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready", 180, router)
        metrics = f"http://127.0.0.1:{ports.metrics}"
        client = PrebleClient(f"127.0.0.1:{ports.http}", f"127.0.0.1:{ports.grpc}", api_key=KEY)

        def ask(prompt: str) -> dict:
            return client.generate(prompt, GREEDY, exclude_input_in_output=True, timeout=90)

        def believed(host: Host) -> float | None:
            return metric_value(metrics, "preble_router_cached_pages", f'engine="{engine[host.address]}"')

        def agrees(host: Host) -> bool:
            own = metric_value(f"http://{host.address}:8002", "preble_engine_kv_pages_cached")
            return believed(host) == own

        def exact(*live: Host) -> None:  # after a change, with the trace stopped
            for host in live:
                wait_for(lambda h=host: agrees(h), 20, f"the router's picture of {host.address}'s cache")

        prompts = [f"{PROMPT} Request {i} asks its own question." for i in range(8)]
        expected = {p: ask(p)["text_output"] for p in prompts}
        assert metric_value(metrics, "preble_router_engines") == 2

        # A host is added to the name while the trace runs: new requests reach it.
        trace = Trace(ask, prompts)
        time.sleep(1)
        zone.records[name].append(hosts[2].address)
        wait_for(lambda: engine[hosts[2].address] in trace.served_by(), 60, "the new host serves")
        trace.stop(expected)
        exact(*hosts)

        # One is removed from the name: its requests finish, then none go there, then its pod stops.
        trace = Trace(ask, prompts)
        time.sleep(1)
        zone.records[name].remove(hosts[0].address)
        wait_for(lambda: believed(hosts[0]) == 0, 60, "the departed host drained and forgotten")
        left = time.monotonic()
        wait_for(lambda: trace.answered(since=left) >= 16, 60, "requests asked since answered")
        trace.stop(expected)
        assert engine[hosts[0].address] not in trace.served_by(since=left)
        assert trace.served_by(since=left) == {engine[hosts[1].address], engine[hosts[2].address]}
        engines[0].send_signal(signal.SIGTERM)
        assert engines[0].wait(60) == 0
        exact(hosts[1], hosts[2])

        # One host's network is cut under the trace: routed around within the health timeout.
        trace = Trace(ask, prompts)
        time.sleep(1)
        hosts[1].link(up=False)
        up = lambda host: metric_value(metrics, "preble_router_engine_up", f'engine="{engine[host.address]}"')  # noqa: E731
        assert wait_for(lambda: up(hosts[1]) == 0, 30, "the cut host is down") < 3 + 5
        cut = time.monotonic()
        wait_for(lambda: trace.answered(since=cut) >= 16, 60, "requests asked since answered")
        trace.stop(expected)  # its running requests moved to host 2 and finished there
        assert trace.served_by(since=cut) == {engine[hosts[2].address]}
        assert believed(hosts[1]) == 0  # its cache is forgotten
        exact(hosts[2])

        # The link comes back: the monitor sees it answer and routes to it again.
        hosts[1].link(up=True)
        wait_for(lambda: up(hosts[1]) == 1, 60, "the host is back")
        trace = Trace(ask, prompts)
        wait_for(lambda: engine[hosts[1].address] in trace.served_by(), 60, "the host that came back serves")
        trace.stop(expected)
        exact(hosts[1], hosts[2])
        for process, _ in reversed(pods.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                assert process.wait(60) == 0
    finally:
        pods.stop()
