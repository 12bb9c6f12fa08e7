"""What the router tells the policy of each engine, without a server: every answered health
probe hands its load snapshot over (a joining engine's before it is up), to whichever
policy routes now, and a policy swapped in by the admin ``configure`` starts from each
engine's last report. E2 takes an engine's KV and host tier from them
(test_host_tier_routing)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from test_router_health import FakeEngine, wait_for

from preble_backend.router.engines.engine_monitor import EngineMonitor
from preble_backend.router.engines.first_probes import FirstProbes

ROOT = Path(__file__).resolve().parents[1]


def test_a_joining_engine_s_first_snapshot_comes_before_it_is_up():
    events: list[tuple] = []

    def load(i: int, snapshot: dict) -> None:
        if i == 1 and not any(e[0] == "load" for e in events):
            events.append(("load", i, snapshot["pid"]))

    monitor = EngineMonitor([FakeEngine("e0", os.getpid())], lambda i, why: events.append(("down", i)),
                            lambda i: events.append(("up", i)), 0.02, 5.0, on_load=load)  # fmt: skip
    monitor.start()
    try:
        newcomer = FakeEngine("e1", os.getpid())
        newcomer.fail = "not loaded yet"
        monitor.watch(1, newcomer)
        time.sleep(0.1)
        assert events == []  # no answer, nothing to learn
        newcomer.fail = None
        assert wait_for(lambda: events == [("load", 1, os.getpid()), ("up", 1)])
    finally:
        monitor.stop()


def test_requests_wait_for_the_starting_engines_first_answers_but_never_past_the_timeout():
    """Before an engine's first probe the policy knows neither its role nor its KV: a request
    waits until every starting engine answered or was found down, at most the timeout."""

    async def scenario() -> None:
        gate = FirstProbes(2)
        waiting = asyncio.create_task(gate.wait(5.0))
        await asyncio.sleep(0.05)
        gate.settled(0)  # answered
        await asyncio.sleep(0.05)
        assert not waiting.done()  # engine 1 is not yet known
        gate.settled(1)  # found down: known too
        assert await asyncio.wait_for(waiting, 1.0) is True
        assert await FirstProbes(0).wait(0.0) is True  # nothing to wait for
        silent = FirstProbes(1)  # neither answers nor fails: routed on what is known
        started = time.monotonic()
        assert await silent.wait(0.2) is False and time.monotonic() - started < 1.0

    asyncio.run(scenario())


# The router's modules import Triton's ``pb_utils``, which only exists inside a Python
# backend's stub process: run them in a child with a stand-in that answers anything.
STAND_IN = """
class _Any:
    def __getattr__(self, name):
        return _Any()

    def __call__(self, *args, **kwargs):
        return _Any()


def __getattr__(name):
    return _Any()
"""

SCENARIO = """
from types import SimpleNamespace
from preble_backend.router.cluster.admin_control import AdminControl
from preble_backend.router.engines.event_feed import EventFeed
from preble_backend.router.cluster.router_state import RouterState
from preble_backend.router.cluster.tenant_shares import ClusterShares
from preble_backend.router.engines.first_probes import FirstProbes
from scheduler.policies import make_policy
from scheduler.policy import InstanceLoad

tiered = {"kv_pages_total": 120, "page_size": 1, "kv_host_pages_total": 64}
plain = {"kv_pages_total": 80, "page_size": 1}
facts = {"capacity_tokens": 1000, "page_size": 1}
router = SimpleNamespace(
    engines=[None, None], feeds=[EventFeed(), EventFeed()], gauge_cached=lambda slot: None,
    loads=[InstanceLoad(), InstanceLoad()], policy_facts=lambda: facts, policy=make_policy("e2", 2, facts),
    tenant_shares=ClusterShares(), metrics=SimpleNamespace(gauge=lambda *args: None),
    first_probes=FirstProbes(2),
)
tenants = {"service": {"team-a": {"e0@1": 70.0}}, "waiting": {"team-a": 2}, "weights": {}}
RouterState._engine_load(router, 0, {**tiered, "tenants": tenants})  # a probe's answer reaches the policy
assert router.policy.tiered == [True, False] and router.policy.capacity == [120, 1000]  # routing now
assert router.tenant_shares.shares.service("team-a") == 70 and router.tenant_shares.backlogged() == {"team-a"}
assert router.first_probes.unheard == {1}  # requests still wait for engine 1's first answer
router.loads[0].reported, router.loads[1].reported = tiered, plain  # the engines' last reports
AdminControl(router).fresh_policy("e2")
assert router.policy.tiered == [True, False] and router.policy.capacity == [120, 80]
RouterState._engine_load(router, 1, {**plain, "kv_host_pages_total": 32})
assert router.policy.tiered == [True, True] and not router.first_probes.unheard
print("ok")
"""


def test_probes_reach_the_policy_routing_now_and_a_fresh_policy_starts_from_the_last_reports(tmp_path):
    run_scenario(tmp_path, SCENARIO)


CALIBRATION = """
from types import SimpleNamespace
from preble_backend.common.cost_model import CostModel
from preble_backend.common.pass_costs import PassCosts
from preble_backend.router.cluster.router_state import RouterState
from preble_backend.router.cluster.tenant_shares import ClusterShares
from scheduler.policies import make_policy

gauges = {}
record = lambda name, value, labels=None: gauges.__setitem__((name, labels.get("term", "")), value)
router = SimpleNamespace(engines=[SimpleNamespace(name="e0")], metrics=SimpleNamespace(gauge=record),
                         policy=make_policy("e2", 1, {"cost_model": "auto", "page_size": 16}))
smollm2 = {"model": "llama L30 H576 A9/3x64 I1536 V49152", "device": "cpu", "tensor_parallel": 1}
RouterState.calibrate(router, 0, {"cost_facts": smollm2})  # the first probe: the prior that matches
state = lambda: tuple(gauges[f"preble_router_cost_model_{k}", ""] for k in ("learnt", "mismatch"))
assert state() == (0, 0)
truth, engine = CostModel.load("smollm2_cpu").scaled(1.5), PassCosts()  # this host is slower
for k in range(300):
    prefill, decodes = (k * 37) % 600 if k % 3 else 0, 1 + k % 16
    context = prefill + decodes * (100 + (k * 53) % 900)
    engine.add((prefill, decodes, context, 0), truth.iteration_time(prefill, decodes, context))
RouterState.calibrate(router, 0, {"cost_facts": smollm2, "pass_costs": engine.report()})
assert state() == (1, 0) and gauges["preble_router_cost_fit_error", ""] < 1e-3
assert abs(gauges["preble_router_cost_ms", "prefill_per_token"] / truth.prefill_ms_per_token - 1) < 1e-3
router.policy = make_policy("e2", 1, {"cost_model": "tiny_cpu", "page_size": 16})  # another model's, fixed
RouterState.calibrate(router, 0, {"cost_facts": smollm2, "pass_costs": engine.report()})
assert state() == (0, 1)
print("ok")
"""


def test_probes_calibrate_the_policy_and_the_fit_in_use_is_exported(tmp_path):
    """The router's probe thread hands each answer to the policy's fit and exports it: from
    the matching prior, to the learnt fit once passes come; a fixed fit of another model is
    a mismatch for as long as it is used."""
    run_scenario(tmp_path, CALIBRATION)


SWITCH = """
from types import SimpleNamespace
from preble_backend.common.cost_model import CostModel
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.router.cluster.admin_control import AdminControl
from preble_backend.router.engines.event_feed import EventFeed
from scheduler.policies import make_policy
from scheduler.policy import InstanceLoad, RoutingRequest

facts = {"capacity_tokens": 4096, "page_size": 16, "cost_model": "mistral7b_a6000"}
router = SimpleNamespace(engines=[None, None], feeds=[EventFeed(), EventFeed()], gauge_cached=id,
                         policy_facts=lambda: facts, policy=make_policy("e2", 2, facts))
router.loads = [InstanceLoad(), InstanceLoad()]
emulated = {"emulated": "mistral7b_a6000", "slowdown": 10.0}
for slot, role in enumerate(("prefill", "decode")):  # probes answered; no request has finished yet
    router.loads[slot].probed = {"kv_pages_total": 256, "page_size": 16, "role": role, "chunk_size": 512,
                                 "kv_bytes_per_token": 46080, "cost_facts": emulated}
AdminControl(router).fresh_policy("e2")  # what preble bench does before each run
policy = router.policy
assert policy.roles == ["prefill", "decode"] and policy.movable == {0, 1}
assert policy.costs == [CostModel.load("mistral7b_a6000").scaled(10.0)] * 2
prompt = RoutingRequest("r0", list(range(1600)), SamplingParams())
decision = policy.select(prompt, [InstanceLoad(), InstanceLoad()])
assert decision.instance == 1, decision  # decoded where requests decode, never on the prefill engine
print("ok")
"""


def test_a_policy_switched_in_knows_each_engine_s_role_and_costs_before_its_next_probe(tmp_path):
    """The admin switch (``preble bench`` makes one before every run) used to start from the
    engines' last final reports alone: on a fresh stack there were none, so until the next
    probe E2 took a prefill engine for one that decodes whole requests (a run's first
    request decoded there, at three times its TPOT) and priced emulated engines with the named
    fit unscaled."""
    run_scenario(tmp_path, SWITCH)


def run_scenario(tmp_path: Path, code: str) -> None:
    (tmp_path / "triton_python_backend_utils.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
