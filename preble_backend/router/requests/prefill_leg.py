"""A disaggregated request's prefill leg: its prompt prefilled on the prefill engine E2 chose.

The leg is a request of its own to that engine (one token out, which is dropped), asked to
offer the prompt's KV when it ends (``kv_transfer: {"offer": true}``). Its final report
carries the offer, and the router hands it to the decode engine with the request itself;
the decode engine reads what it lacks and computes the rest, so the answer is the one an
aggregated engine gives, token for token (the decode engine samples every token).

A leg that fails (the prefill engine died, refused it, or its stream broke) costs the
request nothing but the time spent: it goes to the decode engine without an offer and
prefills there. The prefill engine is suspected as any engine that fails mid-request.
The policy hears of the leg's end as of any request's, so P's load and tree stay exact.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing

from preble_backend.router.engines.engine_client import EngineError, EngineUnavailable
from preble_backend.serving.protocol import BadRequest, decode_report, report_offer
from scheduler.disagg import prefill_leg
from scheduler.policy import FinishInfo, RoutingRequest

LEG_PARAMS = json.dumps({"max_tokens": 1, "temperature": 0})  # its token is dropped: the cheapest


class PrefillLegs:
    """The router's prefill legs; ``router`` is its ``RouterState``."""

    def __init__(self, router) -> None:
        self.router = router

    def pin(self, flight, routing: RoutingRequest, name: str | None) -> None:
        """The request parameter ``preble_prefill_engine``: the prefill leg on that engine,
        while it is up and is not the engine the request decodes on (then it prefills
        there, aggregated), whatever the policy chose."""
        r = self.router
        if name is None:
            return
        if all(e.name != name for e in r.engines):
            names = ", ".join(e.name for e in r.engines)
            raise BadRequest(f"request parameter preble_prefill_engine={name!r} is invalid: this router's "
                             f"engines are {names}")  # fmt: skip
        if flight.prefill is not None:  # the policy's own leg: forgotten
            r.policy.on_finish(flight.prefill, prefill_leg(routing), FinishInfo())
            flight.prefill = None
        p = next((i for i in r.policy.live if r.engines[i].name == name), None)
        if p is not None and p != flight.instance:
            r.policy.place(prefill_leg(routing), p)
            flight.prefill = p

    async def run(self, instance: int, routing: RoutingRequest, tenant: dict | None = None) -> dict | None:
        """Prefill ``routing``'s prompt on ``instance``: what the decode engine is sent
        (``kv_transfer: {"take": offer}``), or None if it failed."""
        r = self.router
        engine, leg = r.engines[instance], prefill_leg(routing)
        r.loads[instance].in_flight += 1
        info, offer, outcome = FinishInfo(), None, "offered"
        start = time.monotonic()
        try:
            stream = engine.generate(leg.request_id, leg.input_ids, LEG_PARAMS, r.feeds[instance].cursor,
                                     kv={"offer": True}, tenant=tenant)  # fmt: skip
            async with aclosing(stream):
                async for resp in stream:
                    r.monitor.progress(instance)
                    if resp.final and resp.report:
                        batch, load = decode_report(resp.report)
                        r._learn(instance, engine, load)
                        info = FinishInfo(r._mirror(instance, batch), load, None, len(resp.token_ids))
                        offer = report_offer(resp.report)
            if offer is None:
                outcome = "no_offer"  # not a prefill engine after all (its role changed on restart)
        except EngineUnavailable as exc:
            r.monitor.suspect(instance, str(exc))
            outcome = "failed"
        except EngineError:
            outcome = "failed"
        finally:
            r.loads[instance].in_flight -= 1
            r.policy.on_finish(instance, leg, info)  # an empty report on failure: the placement is forgotten
            r.gauge_cached(instance)
        labels = {"engine": engine.name, "outcome": outcome}
        r.metrics.count("preble_router_prefill_legs_total", 1, labels)
        r.metrics.observe("preble_router_prefill_leg_seconds", time.monotonic() - start, labels)
        return {"take": offer} if offer is not None else None
