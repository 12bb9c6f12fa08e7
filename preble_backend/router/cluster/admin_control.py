"""The router's side of the admin control request (``admin.py`` parses and checks it):
run on the router's event loop, answered with the router's state."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from preble_backend.router.cluster.admin import AdminRequest, parse_admin, router_admin_key
from preble_backend.router.cluster.router_state import RouterState
from preble_backend.router.engines.engine_client import EngineError
from scheduler.policies import make_policy


def admin_request(parameters: str | None) -> AdminRequest | None:
    """The admin control request a request's parameters make, if any (checked: a wrong
    key raises ``AdminRefused``). Requests without the word pay one substring test."""
    if not parameters or "preble_admin" not in parameters:
        return None
    try:
        params = json.loads(parameters)
    except (ValueError, RecursionError):
        return None  # parse_generate names the problem
    if not isinstance(params, dict) or "preble_admin" not in params:
        return None
    return parse_admin(params, router_admin_key())


class AdminControl:
    def __init__(self, router: RouterState) -> None:
        self.router = router

    async def run(self, sender, admin: AdminRequest) -> None:
        """Run an admin operation. ``flush`` and ``configure`` need an idle router: a
        policy swapped under open requests would settle them in a policy that never placed
        them."""
        r = self.router
        open_now = len(r.flights.all())
        if admin.op != "status" and open_now:
            message = f"the router is busy ({open_now} requests open): retry when it is idle"
            r.responder.refuse(sender, message, pb_utils.TritonError.UNAVAILABLE)
            return
        flushed = []
        if admin.op in ("flush", "configure"):
            for slot in sorted(r.policy.live):
                engine = r.engines[slot]
                try:
                    await r.loop.run_in_executor(r.tokenize_pool, engine.control, "flush_cache")
                    flushed.append(engine.name)
                except EngineError as exc:
                    pb_utils.Logger.log_warn(f"preble router: flushing {engine.name} failed: {exc}")
            self.fresh_policy(admin.policy or r.policy.name)
        members = sorted(r.membership.members)
        state = {"policy": r.policy.name, "open": open_now, "flushed": flushed,
                 "engines": {r.engines[s].name: s in r.policy.live for s in members}}  # fmt: skip
        roles = getattr(r.policy, "roles", None)  # prefill/decode disaggregation: as the engines said
        if roles:
            state["roles"] = {r.engines[s].name: roles[s] for s in members if s < len(roles)}
        served = r.tenant_shares.shares.snapshot()  # fair shares: this router's copy, as the engines said
        if served:
            state["tenants"] = {t: round(sum(by.values()), 1) for t, by in sorted(served.items())}
        fits = r.policy.cost_fits()  # E2's cost model per engine, and why (issue 63)
        if fits:
            state["cost_models"] = {r.engines[s].name: fits[s].summary() for s in members if s < len(fits)}
        text = pb_utils.Tensor("text_output", np.array([json.dumps(state).encode()], dtype=np.object_))
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[text]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # fmt: skip
        except Exception:
            pass  # the caller left

    def fresh_policy(self, name: str) -> None:
        """A new policy of ``name`` over the same slots, live as the old one's, knowing no
        cache: every engine's next report starts from a snapshot. What each engine is (role,
        KV, costs) it learns from the engine's last probe and report before it routes, not
        from the next probe: a fresh stack has no report, and the first second's requests
        went to the prefill engine whole (docs/benchmarks/disagg.md, "The request a policy
        switch sent to P")."""
        r = self.router
        policy = make_policy(name, len(r.engines), r.policy_facts())
        policy.live = set(r.policy.live)
        for slot, load in enumerate(r.loads):
            policy.learn(slot, {**load.probed, **load.reported})
            if load.probed:  # before it is published: the probe thread calibrates only r.policy
                policy.calibrate(slot, load.probed)
        r.policy = policy
        for slot, feed in enumerate(r.feeds):
            feed.reset()
            r.gauge_cached(slot)
        pb_utils.Logger.log_info(f"preble router: policy {name}, every engine's cache flushed")
