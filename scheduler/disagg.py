"""Prefill/decode disaggregation that E2 prices as a whole, per request.

Engines serve as ``prefill``, ``decode`` or ``both``. For each request, ``E2PD`` weighs:

- **aggregated**: E2's own choice (Algorithm 1) among the instances that decode, at its
  L + M + P, where P is paid by the request and by every request decoding beside it while
  the prefill runs (the batch load model: the interference a local prefill causes);
- **disaggregated**: the best prefill instance P, at L + M + P with the request leaving P
  after one token (its queue and its miss cost there), plus the transfer of the KV the
  decode instance D lacks (``KVLink``: bytes over a measured bandwidth, plus a latency),
  plus D's L (the request decoding in D's batch), M (room for the received KV now) and the
  received KV's PREFILLTIME (the copy holds that room for as long as it stays cached).

The pair's cost splits into a term of P and a term of D, so the best pair is the best P
with the best D: O(instances), not O(P × D). The cheaper of the two wins; a tie stays
aggregated. Told a TTFT bound (``ttft_slo_ms``), where exactly one of the two is expected
to meet it, that one wins: a sum of latencies lets one request wait past the bound to
spare many decodes a few milliseconds each, and goodput counts the one. The anchors'
rules (``disagg_baselines.py``) threshold or pick P and D apart.

A prefill on P is its own request to the policy (``prefill_leg``), so P's load, its tree
and its finish report are counted as any other request's.

This is the router's ``e2``. Given ``roles`` and a ``link`` (the simulator, the tests), it
pairs any instances. Live, it learns both from the engines' reports: an engine's role,
its prefill tokens per pass (``chunk_size``: a prefill-only engine pays a pass per chunk),
whether it can move KV at all (a prefill or decode engine reports ``kv_bytes_per_token``),
and the bandwidth its reads reached (``kv_transfer_gbps``; ``link_gbps`` until one is
measured). Only engines that move KV are paired; where none does, it is E2 exactly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from preble_backend.common.settings import DEFAULT_CHUNK_SIZE, ROLES, check_roles
from scheduler.e2 import E2
from scheduler.load_cost import memory_cost
from scheduler.policy import Decision, FinishInfo, InstanceLoad, RoutingRequest

log = logging.getLogger("preble.e2")

LEG = "#prefill"  # a prefill leg's request id: the request's, with this after it


@dataclass(frozen=True)
class KVLink:
    """What moving KV between two instances costs: ``bandwidth_gbps`` GB/s after a fixed
    ``latency_ms`` per transfer, ``kv_bytes_per_token`` bytes per token moved."""

    bandwidth_gbps: float
    latency_ms: float
    kv_bytes_per_token: int

    def transfer_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_ms + tokens * self.kv_bytes_per_token / (self.bandwidth_gbps * 1e6)


def prefill_leg(request: RoutingRequest) -> RoutingRequest:
    """The request as its prefill instance sees it: the same prompt, one token out."""
    params = replace(request.params, max_tokens=1)
    return RoutingRequest(request.request_id + LEG, request.input_ids, params, chains=request.chains)


class EngineRoles:
    """Mixed into a prefill/decode policy (``E2PD``, the anchors' rules) before ``Policy``:
    each engine's role and which engines move KV, as given (the simulator) or as the engines
    report them. Only engines that move KV of one shape (bytes per token, cut over as many
    tensor-parallel ranks: rank r reads rank r's slice) are paired."""

    live: set[int]

    def _init_roles(self, num_instances: int, roles, kv_shape: int | None = None) -> None:
        given = tuple(roles)
        roles = given or ("both",) * num_instances
        check_roles(roles)
        if len(roles) != num_instances:
            raise ValueError(f"{len(roles)} engine roles for {num_instances} engines")
        self.roles = list(roles)
        self.movable = set(range(num_instances)) if given else set()  # engines that move KV
        self.kv_shape = kv_shape  # their KV's bytes per token
        self.kv_ranks = 0  # and the tensor-parallel ranks it is cut over (0: none reported yet)
        self.mismatched: set[int] = set()  # engines whose KV shape differs from it

    def _learn_role(self, instance: int, load: dict) -> int:
        """An engine's role from its report; the bytes per token of KV it moves, if it can be
        paired (0: it moves none, or of another shape)."""
        if load.get("role") in ROLES:
            self.roles[instance] = load["role"]
        per_token, ranks = int(load.get("kv_bytes_per_token") or 0), int(load.get("kv_ranks") or 1)
        if not per_token:
            return 0
        if (self.kv_shape is not None and per_token != self.kv_shape) or (self.kv_ranks or ranks) != ranks:
            if instance not in self.mismatched:  # its pools cannot take the others' pages
                self.mismatched.add(instance)
                log.error("instance %d's KV takes %d bytes per token over %d ranks, the others' %d over %d: "
                          "it is not paired for prefill/decode disaggregation", instance, per_token, ranks,
                          self.kv_shape, self.kv_ranks or 1)  # fmt: skip
            return 0
        self.kv_shape, self.kv_ranks = per_token, ranks
        self.movable.add(instance)
        return per_token

    def _with(self, role: str) -> set[int]:
        return {i for i in self.live if self.roles[i] in (role, "both")}

    def _decoders(self) -> set[int]:
        """Where requests decode: while no engine that decodes is up, any (a role only
        steers the policy)."""
        return self._with("decode") or set(self.live)


class E2PD(EngineRoles, E2):
    def __init__(self, num_instances: int, roles: tuple[str, ...] | list[str] = (),
                 link: KVLink | None = None, link_gbps: float = 10.0, link_latency_ms: float = 1.0,
                 tpot_slo_ms: float = 0.0, ttft_slo_ms: float = 0.0, **e2_options) -> None:  # fmt: skip
        super().__init__(num_instances, **e2_options)
        self._init_roles(num_instances, roles, link.kv_bytes_per_token if link else None)
        self.link = link
        self.link_gbps, self.link_latency_ms = link_gbps, link_latency_ms
        self.tpot_slo_ms = tpot_slo_ms  # 0: none; else no local prefill that breaks it where a pair can serve
        self.ttft_slo_ms = ttft_slo_ms  # 0: none; else the one of aggregated and the pair expected to meet it
        self.chunk = [DEFAULT_CHUNK_SIZE] * num_instances  # each engine's prefill tokens per pass
        self._arriving: dict[str, tuple[RoutingRequest, int]] = {}  # id -> (request, D) while its leg runs

    def _grow(self) -> None:
        super()._grow()
        self.roles.append("both")
        self.chunk.append(DEFAULT_CHUNK_SIZE)

    def learn(self, instance: int, load: dict) -> None:
        """An engine's role, its prefill tokens per pass, and what moving its KV costs, from
        its report."""
        super().learn(instance, load)
        self.chunk[instance] = int(load.get("chunk_size") or self.chunk[instance])
        per_token = self._learn_role(instance, load)
        if not per_token:
            return
        measured = float(load.get("kv_transfer_gbps") or 0.0)
        gbps = measured or (self.link.bandwidth_gbps if self.link else self.link_gbps)
        self.link = KVLink(gbps, self.link_latency_ms, per_token)

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        """Aggregated or a pair, the cheaper; while no engine that decodes is up, a prefill
        engine serves whole requests (it can: a role only steers E2)."""
        self.reprice()
        decoders = self._decoders()
        prefillers = self._with("prefill") & self.movable
        if not prefillers or not decoders & self.movable or self.link is None:
            with self.only(decoders):
                return super().select(request, loads)
        now = self.clock()
        match = self.tree.match(request.chain(self.page_size))
        prompt_len = len(request.input_ids)
        with self.only(decoders):
            aggregated = self.choose(request, loads, match, now)
        agg_cost = self.load_cost(aggregated.instance, match, prompt_len, now)
        leg = {i: self.load_cost(i, match, prompt_len, now, decode_len=1.0) for i in prefillers}
        slo = self.tpot_slo_ms
        if slo:  # no prefill, local or a leg, where the requests decoding would miss the SLO with it
            if self.tpot_with_prefill(aggregated.instance, match, prompt_len, now) > slo:
                agg_cost = math.inf
            for i in leg:  # (an instance that prefills only has none decoding)
                if self.tpot_with_prefill(i, match, prompt_len, now, joins=False) > slo:
                    leg[i] = math.inf
        p = min(sorted(leg), key=leg.__getitem__)
        rest = {i: self.decode_leg_cost(i, match, prompt_len, now) for i in (decoders & self.movable) - {p}}
        if not rest:
            self._record(request, aggregated.instance, match, now)
            return aggregated
        d = min(sorted(rest), key=rest.__getitem__)
        pair_cost = leg[p] + rest[d]
        pair_wins = pair_cost < agg_cost
        if self.ttft_slo_ms and math.isfinite(agg_cost) and math.isfinite(pair_cost):
            local = self.ttft_aggregated(aggregated.instance, match, prompt_len, now) <= self.ttft_slo_ms
            if local != (self.ttft_disaggregated(p, d, match, prompt_len, now) <= self.ttft_slo_ms):
                pair_wins = not local  # exactly one meets the bound: that one
        if not pair_wins:
            self._record(request, aggregated.instance, match, now)
            return aggregated
        self._record(prefill_leg(request), p, match, now)
        self._count(request, d, match, now, received=True)
        self._arriving[request.request_id] = (request, d)
        return Decision(d, "disaggregate", prefill=p)

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        """A prefill leg's end routes its request on D in the tree: D holds the prompt from
        then on (its KV moves, or D prefills it where the leg failed). Routed at the
        decision, D looked as if it held the prompt while the leg still waited in P's
        queue, and the requests that shared it and followed to D computed it again there
        (70B, programming at stress: 32% more tokens computed, docs/benchmarks/disagg.md,
        "Followers of a prompt still on P")."""
        super().on_finish(instance, request, info)
        arriving = self._arriving.pop(request.request_id.removesuffix(LEG), None)
        if arriving is None:
            return
        whole, d = arriving
        if self._answers(request):  # the request itself ended before its leg did
            self.history[d].finish(whole.request_id)
        else:
            self._route(whole, d, self.tree.match(whole.chain(self.page_size)), self.clock())

    def _answers(self, request: RoutingRequest) -> bool:
        return not request.request_id.endswith(LEG)

    def tpot_with_prefill(
        self, instance: int, match, prompt_len: int, now: float, joins: bool = True
    ) -> float:
        """The time per output token of the requests decoding on ``instance`` if this
        prompt's missed tokens prefill there too (ms; 0 where none decodes or nothing is
        missed): a decode step of its batch with the request in it (``joins``; a leg leaves
        after its prefill), stretched by the share of the instance's time that prefills
        take, the ones routed there within the window and this one (chunked prefill runs
        them in the passes that decode). Legs in flight there do not decode."""
        h, cost = self.history[instance], self.costs[instance]
        missed = prompt_len - match.cached_on(instance)
        if h.decoders <= 0 or missed <= 0:
            return 0.0
        d = max(1.0, self.decode_lengths.average(now))
        b = h.decoders + joins
        step = cost.iteration_time(0, b, round(h.in_flight_tokens + prompt_len + b * d / 2))
        prefilling = h.prefill_share(now, cost.prefill_time(missed))
        return step / (1.0 - prefilling) if prefilling < 1.0 else math.inf

    def ttft_aggregated(self, instance: int, match, prompt_len: int, now: float) -> float:
        """The request's expected time to first token prefilled where it decodes (ms): the
        prefill queued there ahead of it (``InstanceHistory.queued_prefill``) and its own,
        in chunked passes that each also run a decode step of the requests decoding there
        (the step less the pass's base, which the prefill pays already). Unbounded where its
        KV would not fit beside the requests in flight (``InstanceHistory.queued``): no
        first token is promised there, and without this the bound kept prompts on decode
        instances out of room (70B, 1 P + 3 D, programming at stress, trace 0: goodput
        0.472 -> 0.083; docs/benchmarks/disagg.md)."""
        if self._out_of_room(instance, prompt_len, now):
            return math.inf  # it would wait for room too, for as long as requests take to finish
        h, cost = self.history[instance], self.costs[instance]
        b = h.decoders
        missed = max(1, prompt_len - match.cached_on(instance))
        work = h.queued_prefill(now) + self.prefill_time(instance, missed)
        if b <= 0:
            return work
        d = max(1.0, self.decode_lengths.average(now))
        step = cost.iteration_time(0, b, round(h.in_flight_tokens + b * d / 2)) - cost.base_ms
        passes = math.ceil(work / max(1e-9, self.prefill_time(instance, self.chunk[instance])))
        return work + passes * max(0.0, step)

    def ttft_disaggregated(self, p: int, d: int, match, prompt_len: int, now: float) -> float:
        """The same for the pair (ms): P's queued prefill and the leg's, then the transfer of
        what D lacks. D admits a received request ahead of its queue, so its wait there is
        not counted, unless D is out of room for it (unbounded, as above)."""
        if self._out_of_room(d, prompt_len, now):
            return math.inf
        missed = max(1, prompt_len - match.cached_on(p))
        work = self.history[p].queued_prefill(now) + self.prefill_time(p, missed)
        return work + self.link.transfer_ms(prompt_len - match.cached_on(d))

    def _out_of_room(self, instance: int, prompt_len: int, now: float) -> bool:
        """Whether the prompt's KV would wait for room beside the requests in flight there."""
        d = max(1.0, self.decode_lengths.average(now))
        return self.history[instance].queued(d, prompt_len, self.capacity[instance]) > 0

    def prefill_time(self, instance: int, tokens: int) -> float:
        """PREFILLTIME, and on a prefill-only instance the base of every chunk's pass: with
        nothing decoding there, each ``chunk`` tokens are a pass of their own, where
        PREFILLTIME counts one (measured, P's queue was priced 23% short,
        docs/benchmarks/disagg.md)."""
        time = super().prefill_time(instance, tokens)
        if self.roles[instance] != "prefill" or tokens <= self.chunk[instance]:
            return time
        return time + self.costs[instance].base_ms * (math.ceil(tokens / self.chunk[instance]) - 1)

    def decode_leg_cost(self, instance: int, match, prompt_len: int, now: float) -> float:
        """The transfer of what ``instance`` lacks, then the request decoding in its batch
        (L), the room its received KV takes now (M), and that KV's PREFILLTIME: the copy
        stays cached beside P's for as long as it is used, holding room that later
        requests would otherwise cache (M prices only the nodes evicted for it now, each
        once). Without it a pair won on a few milliseconds of decode-batch relief and its
        prompt waited in P's queue (docs/benchmarks/disagg.md, "What a pair's copy costs")."""
        lacking = prompt_len - match.cached_on(instance)
        d = self.decode_lengths.average(now)
        cost = self.costs[instance]
        need = self.tree.held_tokens[instance] + lacking - self.capacity[instance]
        evicted = 0.0
        if need > 0:
            host = self.tree.host.pages[instance] if self.tiered[instance] else None
            evicted = memory_cost(self.tree, instance, need, match, now, cost, host, False)
        batch = self._batch_load(instance, match, prompt_len, now, d)
        return self.link.transfer_ms(lacking) + batch + evicted + self.prefill_time(instance, lacking)
