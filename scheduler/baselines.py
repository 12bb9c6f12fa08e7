"""Baseline policies behind the same interface as E2, with their published defaults.

- ``prefix_hash``: consistent hashing of the first K prompt tokens; a stand-in for the
  paper's oracle partition (requests with the same leading K tokens always meet).
- ``cache_aware``: SGLang's router. Per worker an approximate tree of the tokens routed
  there; if the pending-request gap is large (max − min > 64 and max > 1.5 · min) go to
  the least loaded worker, else to the best prefix match if its match rate exceeds 0.3,
  else to the least loaded.
- ``kv_cost``: NVIDIA Dynamo's KV router. Overlap comes from the engines' KV events;
  cost = overlap_weight · blocks to prefill + active blocks of in-flight requests; lowest
  wins.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from array import array
from collections.abc import Callable

from preble_backend.common.settings import DEFAULT_PAGE_SIZE
from scheduler.global_tree import GlobalPrefixTree
from scheduler.policy import Decision, FinishInfo, InstanceLoad, MirrorsCaches, Policy, RoutingRequest


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class PrefixHash(Policy):
    name = "prefix_hash"

    def __init__(
        self,
        num_instances: int,
        prefix_tokens: int = 512,
        virtual_nodes: int = 160,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(num_instances, clock)
        self.prefix_tokens = prefix_tokens
        self.virtual_nodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[int] = []
        for i in range(num_instances):
            self._join_ring(i)

    def _join_ring(self, instance: int) -> None:
        """The instance's points on the ring: a joining one takes over ~1/N of the keys,
        from every other instance alike, and the rest stay where they were."""
        for v in range(self.virtual_nodes):
            point = _hash(f"instance-{instance}-{v}".encode())
            at = bisect.bisect(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, instance)

    def _grow(self) -> None:
        self._join_ring(self.num_instances - 1)

    def select(self, request, loads):
        key = _hash(array("q", request.input_ids[: self.prefix_tokens]).tobytes())  # int64s, as numpy's
        at = bisect.bisect(self._points, key) % len(self._points)
        while self._owners[at] not in self.live:  # the next live owner on the ring
            at = (at + 1) % len(self._points)
        return Decision(self._owners[at], "hash")


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        num_instances: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 22,
        page_size: int = DEFAULT_PAGE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(num_instances, clock)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.page_size = page_size
        self.trees = [GlobalPrefixTree(1, float("inf"), page_size) for _ in range(num_instances)]

    def _grow(self) -> None:
        self.trees.append(GlobalPrefixTree(1, float("inf"), self.page_size))

    def select(self, request, loads: list[InstanceLoad]):
        live = sorted(self.live)
        pending = [load.in_flight for load in loads]
        least = min(live, key=lambda i: (pending[i], i))
        most = max(pending[i] for i in live)
        if most - pending[least] > self.balance_abs and most > self.balance_rel * pending[least]:
            choice, branch = least, "balance"
        else:
            chain = request.chain(self.page_size)
            matched = {i: self.trees[i].match(chain).matched for i in live}
            best = max(live, key=lambda i: (matched[i], -pending[i]))
            if matched[best] / len(request.input_ids) > self.cache_threshold:
                choice, branch = best, "cache_hit"
            else:
                choice, branch = least, "cache_miss"
        self.record(request, choice)
        return Decision(choice, branch)

    def record(self, request, instance: int) -> None:
        tree = self.trees[instance]
        tree.route(request.chain(self.page_size), 0, self.clock())
        drop_oldest_leaves(tree, self.max_tree_tokens)

    def forget(self, instance: int) -> None:
        self.trees[instance] = GlobalPrefixTree(1, float("inf"), self.page_size)


class KVCost(MirrorsCaches, Policy):
    name = "kv_cost"

    def __init__(
        self,
        num_instances: int,
        overlap_weight: float = 1.0,
        page_size: int = DEFAULT_PAGE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(num_instances, clock)
        self.overlap_weight = overlap_weight
        self.block_size = page_size  # Dynamo's KV block is the engine's page
        self.tree = GlobalPrefixTree(num_instances, page_size=page_size)  # fed by KV events only
        self.active_blocks = [0] * num_instances
        self._blocks: dict[str, int] = {}
        self._next = 0

    def select(self, request, loads):
        match = self.tree.match(request.chain(self.block_size))
        blocks = -(-len(request.input_ids) // self.block_size)
        costs = {}
        for i in self.live:
            overlap = match.cached_on(i) // self.block_size
            costs[i] = self.overlap_weight * (blocks - overlap) + self.active_blocks[i]
        order = [(self._next + k) % self.num_instances for k in range(self.num_instances)]
        choice = min((i for i in order if i in costs), key=lambda i: costs[i])
        self._next = (choice + 1) % self.num_instances
        self.record(request, choice)
        return Decision(choice, "kv_cost")

    def record(self, request, instance: int) -> None:
        blocks = -(-len(request.input_ids) // self.block_size)
        self.active_blocks[instance] += blocks
        self._blocks[request.request_id] = blocks

    def _grow(self) -> None:
        self.tree.add_instance()
        self.active_blocks.append(0)

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        self.tree.apply_events(instance, info.events)
        self.active_blocks[instance] -= self._blocks.pop(request.request_id, 0)


def drop_oldest_leaves(tree: GlobalPrefixTree, max_tokens: int) -> None:
    """Remove the tree's least recently routed leaves until it holds at most ``max_tokens``
    (a one-instance tree): how SGLang's router trims its approximate per-worker trees (a
    tree that routing alone fills, with no engine events to mirror)."""
    lru = tree.lru[0]
    while tree.held_tokens[0] > max_tokens and lru:
        leaf = next(node for node in lru if not node.children)
        del lru[leaf], leaf.parent.children[leaf.hashes[0]]
        tree.held_tokens[0] -= len(leaf.hashes) * tree.page_size
