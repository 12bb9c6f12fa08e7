"""A request whose engine died while it ran: whether it moves on, where it goes on from,
and when it is a suspected poison request instead.

It moves on at most ``migration_limit`` times (default 1), from its prompt plus the
tokens already generated (as NVIDIA Dynamo migrates). Before a migrating request counts
its new engine's failure against itself, that engine must answer a probe: two engines
dead at once are not the request's doing. A request whose engines failed under it past
the limit is failed with an error its client does not retry, and an identical one is
refused for ``poison_ttl_s`` (``requests/quarantine.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import triton_python_backend_utils as pb_utils

from preble_backend.router.cluster.router_state import RouterState
from preble_backend.router.engines.engine_client import EngineClient
from preble_backend.router.requests.answer import Answer
from preble_backend.router.requests.flights import Flight
from preble_backend.serving.protocol import BadRequest, GenerateRequest
from scheduler.policy import RoutingRequest


class Migration:
    def __init__(self, router: RouterState) -> None:
        self.router = router

    async def answers(self, flight: Flight, engine: EngineClient) -> bool:
        """Whether the engine a migrating request was placed on answers a health probe now,
        so that its failure under the request is one the request saw it through (two
        engines dead at once are not the request's doing); if not, the placement is undone
        and the monitor judges the engine before the request is placed again."""
        r = self.router
        try:
            await asyncio.wait_for(r.loop.run_in_executor(r.tokenize_pool, engine.health),
                                   r.config.health_timeout_s)  # fmt: skip
            return True
        except Exception as exc:
            r.monitor.suspect(flight.instance, f"{type(exc).__name__}: {exc}")
            r.settle(flight)
            flight.instance, flight.settled, flight.engine_finished = None, False, False
            await asyncio.sleep(r.config.health_interval_s)
            return False

    def poisoned(self, req: GenerateRequest, failures: int, reason: str) -> BadRequest:
        """The request's last engine failed too: remember it (``requests/quarantine.py``) and fail it
        with an error its client does not retry."""
        r = self.router
        r.quarantine.add(req.prompt, req.params_json)
        r.metrics.count("preble_router_poisoned_total", 1, {"policy": r.policy.name})
        ttl = r.config.poison_ttl_s
        pb_utils.Logger.log_error(f"preble router: a request ran on each of {failures} engines that failed "
                                  f"(last: {reason}); refused for {ttl:g} s")  # fmt: skip
        return BadRequest(f"this request failed: each of the {failures} engines that ran it failed under it; "
                          f"it is refused for {r.config.poison_ttl_s:g} s (poison_ttl_s)")  # fmt: skip

    def may_migrate(self, flight: Flight, req: GenerateRequest, answer: Answer, migrations: int) -> bool:
        r = self.router
        return (migrations < r.config.migration_limit and not flight.closed and not flight.client_gone
                and answer.num_output < req.params.max_tokens)  # fmt: skip

    def continued(self, flight: Flight, req: GenerateRequest, routing: RoutingRequest, answer: Answer,
                 reason: str) -> tuple[RoutingRequest, str]:  # fmt: skip
        """Forget the dead placement; the request goes on from its prompt plus the tokens
        already generated, for the tokens it has left (as NVIDIA Dynamo migrates). Greedy
        decoding continues exactly, and a structured output's grammar resumes where it
        was; a seeded sample or a frequency/presence penalty sees the earlier tokens as
        prompt, so it may differ from an undisturbed run."""
        r = self.router
        old = r.engines[flight.instance].name
        r.settle(flight)
        flight.instance, flight.settled, flight.engine_finished = None, False, False
        generated = answer.num_output
        guided = (*req.params.guided_prefix_ids, *answer.token_ids) if req.params.guide else ()
        params = dataclasses.replace(
            req.params, max_tokens=req.params.max_tokens - generated,
            min_tokens=max(0, req.params.min_tokens - generated), guided_prefix_ids=guided,
        )  # fmt: skip
        prompt = [*routing.input_ids[: answer.num_input_tokens], *answer.token_ids]
        continued = RoutingRequest(uuid.uuid4().hex, prompt, params)
        continued.chain(r.config.page_size)
        raw = json.loads(req.params_json) if req.params_json else {}
        raw.update(max_tokens=params.max_tokens, min_tokens=params.min_tokens)
        if guided:  # the new engine's grammar matcher resumes after the tokens so far
            raw["guided_prefix_ids"] = list(guided)
        r.metrics.count("preble_router_migrations_total", 1, {"policy": r.policy.name, "engine": old})
        pb_utils.Logger.log_warn(f"preble router: engine {old} failed ({reason}); request continues "
                                 f"elsewhere after {generated} tokens")  # fmt: skip
        return continued, json.dumps(raw)
