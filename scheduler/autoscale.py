"""E2's prefix autoscaling (paper §4.2): a key portion too hot for the instances holding it
gets replicas on others, and they retire when it cools. Four rules make a replica: the
paper's (its requests' time to first token doubles within the window), two of ours that
fire while the prefix is hot (it draws more than its holders' share of the cluster while
they carry over ``hot_load_factor`` × the mean; every holder would queue the request
behind what its KV holds), and a replica whose recompute pays over the requests that
would follow it (``_replica_that_pays``). A mixin of ``E2``: it reads E2's tree, load
history and cost model."""

from __future__ import annotations

import logging

from preble_backend.common.cost_model import CostModel
from scheduler.global_tree import GlobalPrefixTree
from scheduler.load_cost import DecodeLengths, InstanceHistory
from scheduler.tree_node import NO_REPLICAS, GlobalNode, Match
from scheduler.ttft_history import TTFTHistory

log = logging.getLogger("preble.e2")


class Autoscaling:
    tree: GlobalPrefixTree
    history: list[InstanceHistory]
    decode_lengths: DecodeLengths
    costs: list[CostModel]
    capacity: list[int]
    live: set[int]
    page_size: int
    hot_min_requests: int
    hot_load_factor: float
    hot_queue: float | None
    autoscale_min_samples: int
    amortized_replicas: bool
    load_model: str
    load_signal: str

    def _replica_that_pays(self, match: Match, choice: int, prompt_len: int, now: float) -> int | None:
        """Replication priced while the prefix is hot (ours, issue 40): the instance lacking
        the key portion that would serve this request for less than ``choice`` does, once
        the key portion's recompute there is shared by the requests that would follow it.
        Those are the key portion's requests in flight (``n``), a thread below it counted
        once (its later requests follow their own cache) and the request's own not at all;
        split over the serving instances and the new replica, each pays (serving + 1) / n
        of it. Only for a key portion drawing at least ``hot_min_requests`` at once, to a
        holder whose batch load exceeds ``hot_load_factor`` × the mean: the rebalancer
        weighs one request against the whole recompute, so a hot document's holder kept
        every question while its batch, slowed by their long contexts, carried twice the
        others' work (docs/SCHEDULER.md)."""
        key = match.key
        if not self.amortized_replicas or key is None or self.load_model != "batch":
            return None
        serving = self._serving(key)
        least = max(self.hot_min_requests, len(serving) + 2)
        n = sum(key.pending.get(i, 0) for i in serving)  # counted per thread below
        if n < least or not self.live - serving:
            return None
        d = self.decode_lengths.average(now)
        load = {i: self._batch_load(i, match, prompt_len, now, d) for i in self.live}
        if load[choice] <= self.hot_load_factor * sum(load.values()) / len(load):
            return None
        at = match.nodes.index(key)
        own = match.nodes[at + 1] if at + 1 < len(match.nodes) else None
        for child in key.children.values():
            running = sum(child.pending.get(i, 0) for i in serving)
            n -= running if child is own else max(0, running - 1)
        if n < least:
            return None
        key_tokens = min(self.page_size * sum(match.lengths[: at + 1]), match.cached_on(choice))
        shared_by = 1 - (len(serving) + 1) / n

        def amortized(i: int) -> float:
            cached = match.cached_on(i)
            missed, shared = prompt_len - cached, max(0, key_tokens - cached)
            cost = self.costs[i]
            recompute = cost.prefill_time(missed) - cost.prefill_time(missed - shared)
            decoding = self.history[i].decoding(cost.decode_time(d))
            return self.load_cost(i, match, prompt_len, now) - recompute * (1 + decoding) * shared_by

        best = min(sorted(self.live - serving), key=amortized)
        return best if amortized(best) < self.load_cost(choice, match, prompt_len, now) else None

    def _autoscale(self, key: GlobalNode, ttft: float, now: float) -> None:
        if key.ttft is None:
            key.ttft = TTFTHistory()
        history: TTFTHistory = key.ttft
        history.add(now, ttft, self.tree.window_s)
        if history.doubled(self.autoscale_min_samples) or self._too_hot(key, now):
            self._replicate(key, now)
        elif key.replicas and self._cooled(key, now):
            log.info("autoscale: replicas %s of a key portion retired", sorted(key.replicas))
            key.replicas = NO_REPLICAS

    def _cooled(self, key: GlobalNode, now: float) -> bool:
        """Replicas retire when the key portion has cooled (ours): its requests within W fit
        the share of the cluster's that its holders carry without them (the too-hot rule's
        first condition, turned round). A retired replica still caching it serves it as a
        holder; one that evicted it stops drawing requests that would recompute it."""
        uses, routed = self._window_share(key, now)
        return uses * len(self.live) <= routed * len(key.holders() & self.live)

    def _window_share(self, key: GlobalNode, now: float) -> tuple[int, int]:
        """The key portion's requests within W on the live instances, and all of theirs."""
        uses = sum(self.tree.requests_in_window(key, i, now) for i in self.live)
        return uses, sum(self.history[i].routed_in_window(now) for i in self.live)

    def _too_hot(self, key: GlobalNode, now: float) -> bool:
        """A key portion's load is too high for its holders (§4.2, autoscaling) when it drew
        more of the window's requests than its holders' share of the cluster and each
        holder's load over the window exceeds ``hot_load_factor`` × the mean. The TTFT
        rule misses a prefix that is hot from the start (its TTFT never doubles: its
        holder's decoding slows instead), and rebalancing waits for ``Th_bal`` × the
        *lightest* load. The second condition spares a key portion whose traffic its
        holder carries well (an agent's episode is 1/8 of the traffic while eight run at
        once)."""
        if sum(map(len, key.hits.values())) < self.hot_min_requests:  # a bound, before trimming
            return False
        serving = self._serving(key)
        uses, routed = self._window_share(key, now)
        if not serving or uses < self.hot_min_requests:
            return False
        if uses * len(self.live) <= routed * len(serving):  # no more than the servers' share
            return False
        load = {i: self.load(i, now, "history") for i in self.live}
        mean = sum(load.values()) / len(load)
        return all(load[i] > self.hot_load_factor * mean for i in serving)

    def _queued_everywhere(self, key: GlobalNode, holders: set[int], prompt_len: int, now: float) -> bool:
        """Autoscaling while a prefix is hot (ours): every instance serving it would queue
        the request behind at least ``hot_queue`` requests its KV cannot hold, and the
        instance that would become its replica would not. The TTFT rule waits for a
        window's newer half to be slow, the too-hot rule for a request to finish; a hot
        document in a chat trace drew a third of the requests onto its holder before either
        fired. Where every instance queues alike (KV short of the working set) a replica
        relieves nobody: it copies the prefix into a KV that is already evicting."""
        if self.hot_queue is None:
            return False
        d = self.decode_lengths.average(now)

        def queued(i: int) -> float:
            return self.history[i].queued(d, prompt_len, self.capacity[i])

        if any(queued(i) < self.hot_queue for i in holders):
            return False
        replica = self._replica_for(key, now)
        return replica is not None and queued(replica) < self.hot_queue

    def _serving(self, key: GlobalNode) -> set[int]:
        """The live instances that hold the key portion or replicate it."""
        return (key.holders() | key.replicas) & self.live

    def _replica_for(self, key: GlobalNode, now: float) -> int | None:
        """The least loaded instance that lacks the key portion (None: every one has it)."""
        lacking = sorted(self.live - self._serving(key))
        return min(lacking, key=lambda i: self.load(i, now, self.load_signal)) if lacking else None

    def _replicate(self, key: GlobalNode, now: float, replica: int | None = None) -> None:
        """``replica``, or the least loaded instance that lacks the key portion, becomes a
        replica."""
        replica = self._replica_for(key, now) if replica is None else replica
        if replica is not None:
            key.replicas = key.replicas | {replica}
            key.ttft = None  # measure afresh with the replica serving
            log.info(
                "autoscale: key portion of %d tokens replicated on instance %d",
                len(key.hashes) * self.page_size,
                replica,
            )
