"""The simulator's prefill/decode model: a disaggregated request prefills on P (a leg of
one token, its own request there), its KV moves to D over a ``KVLink`` (the pages D lacks
when P's leg finishes, at the link's latency plus bytes over bandwidth), and it then runs
on D whole: D finds the moved pages in its radix cache, computes the prompt's last partial
page (only whole pages move, as vLLM's NIXL connector moves whole blocks) and decodes
every output token. Its time to first token is D's first token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from scheduler.disagg import LEG, KVLink, prefill_leg
from scheduler.policy import Decision, InstanceLoad, RoutingRequest


class Legs:
    """The disaggregated requests of one run, between P's leg and D's start."""

    def __init__(self, link: KVLink | None, instances: list, loads: list[InstanceLoad], routing: dict,
                 start: Callable, later: Callable) -> None:  # fmt: skip
        self.link = link
        self.instances, self.loads, self.routing = instances, loads, routing
        self.start, self.later = start, later  # start an idle instance; push an event in s
        self.waiting: dict[str, tuple[object, int]] = {}  # leg id -> (the request, its D)
        self.moved_tokens = 0

    def dispatch(self, req, route: RoutingRequest, decision: Decision) -> None:
        """Send the prefill leg to P; the request waits for it (counted on D already)."""
        if self.link is None:
            raise ValueError(f"the policy disaggregated {req.request_id}, but the run has no KV link: "
                             "simulate(..., link=KVLink(...))")  # fmt: skip
        leg = replace(req, request_id=req.request_id + LEG, output_len=1, output_ids=None, after=None)
        self.waiting[leg.request_id] = (req, decision.instance)
        self.routing[leg.request_id] = prefill_leg(route)
        self.loads[decision.prefill].in_flight += 1
        inst = self.instances[decision.prefill]
        inst.add(leg)
        if not inst.busy:
            self.start(inst)

    def leg_done(self, leg_id: str) -> None:
        """P's leg finished: the transfer of what D lacks starts now."""
        req, d = self.waiting.pop(leg_id)
        inst = self.instances[d]
        lacking = len(req.input_ids) // inst.pool.page_size * inst.pool.page_size - _held(inst, req.input_ids)
        self.later(self.link.transfer_ms(lacking) / 1000.0, "received", (req, d))

    def received(self, req, d: int) -> None:
        inst = self.instances[d]
        self.moved_tokens += receive(inst, req.input_ids)
        inst.add(req, received=True)
        if not inst.busy:
            self.start(inst)


def _held(inst, tokens: list[int]) -> int:
    ps = inst.pool.page_size
    pages, _ = inst.cache.match_prefix(tokens[: len(tokens) // ps * ps])
    return len(pages) * ps


def receive(inst, tokens: list[int]) -> int:
    """Store the prompt's whole pages ``inst`` lacks in its radix cache, as a transfer
    does, evicting as a prefill would; returns the tokens stored. Where the pool cannot
    make room, the rest is not stored and D computes it."""
    ps, cache, pool = inst.pool.page_size, inst.cache, inst.pool
    usable = len(tokens) // ps
    have, _ = cache.match_prefix(tokens[: usable * ps])
    want = usable - len(have)
    if want <= 0:
        return 0
    short = want - pool.num_free
    if short > 0 and cache.num_evictable_pages:
        inst.scheduler.blocks.free(cache.evict(min(short, cache.num_evictable_pages)))
    new = pool.alloc(min(want, pool.num_free))
    kept, _ = cache.insert(tokens[: (len(have) + len(new)) * ps], have + new)
    kept = set(kept)
    inst.scheduler.blocks.free([p for p in new if p not in kept])
    return len(new) * ps
