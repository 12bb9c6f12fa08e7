"""A prompt's KV handed from a prefill engine to a decode engine, on each one's own cache.

- The prefill side **offers** the whole pages of a prompt its radix cache holds, with their
  generation stamps (``KVPool.stamps``), and locks them under a lease until the decode side
  releases it or the lease expires (``expire``): pages are never stranded for longer.
- The decode side **takes** only the pages its own radix cache lacks (an earlier turn, the
  shared document): it allocates them (evicting as a prefill would, its own matched prefix
  locked meanwhile), reads them with the transfer it is given (``kv_transfer``), and on
  success caches them, so its cache events tell the global tree it now holds the prompt.
  On any failure (a dead or stalled peer, a page freed while read) it frees what it
  allocated and caches nothing: the request then prefills here, and answers the same.

Only whole pages move; the prompt's last partial page is computed by the decode side, as
vLLM's NIXL connector moves whole blocks. Engines with sliding-window layers are refused:
their window pages are a second pool this handoff does not move yet.

With a host tier, only device pages are offered and counted as held: a prefix the decode
side holds on its host is read again from the prefill side (one path for every case; not
measured against loading it back) and becomes that host node's device copy. Room
made by evicting copies pages down first; on a GPU that copy runs on the compute stream,
which the read (NIXL, not on any stream) does not follow, so the copy is waited for before
the pages are handed to the read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from preble_backend.engine.cache.radix_node import TreeNode
from preble_backend.engine.scheduling.block_manager import BlockManager
from preble_backend.kv_transfer.nixl_transport import TransferResult


@dataclass
class Claim:
    """Pages reserved for an offer's read: ``have`` is what the cache held already."""

    tokens: list[int]
    have: list[int]
    node: TreeNode
    remote: list[int]
    stamps: list[int]
    new: list[int]


@dataclass
class Lease:
    node: TreeNode
    expires: float


class Handoff:
    def __init__(
        self, blocks: BlockManager, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if blocks.cache is None:
            raise ValueError("a KV handoff needs the radix cache (enable_prefix_caching)")
        if blocks.pool.window is not None:
            raise ValueError("a KV handoff cannot move sliding-window layers' KV yet")
        self.blocks, self.cache, self.pool = blocks, blocks.cache, blocks.pool
        self.ttl_s, self.clock = ttl_s, clock
        self.leases: dict[str, Lease] = {}

    def offer(self, lease_id: str, tokens: list[int]) -> dict:
        """The whole pages of ``tokens`` cached here, locked under ``lease_id``: those before
        its last token, which a decode engine computes anyway for its first logits."""
        ps = self.pool.page_size
        pages, node = self.cache.match_prefix(tokens[: (len(tokens) - 1) // ps * ps])
        self.cache.lock(node)
        self.release(lease_id)  # a lease id offered again replaces its lease
        self.leases[lease_id] = Lease(node, self.clock() + self.ttl_s)
        return {"lease": lease_id, "pages": pages, "stamps": self.pool.stamps[pages].tolist(),
                "tokens": len(pages) * ps}  # fmt: skip

    def release(self, lease_id: str) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.cache.unlock(lease.node)
        return lease is not None

    def expire(self) -> int:
        """Release every lease past its time; how many."""
        now = self.clock()
        late = [lease_id for lease_id, lease in self.leases.items() if lease.expires <= now]
        for lease_id in late:
            self.release(lease_id)
        return len(late)

    def reserve(self, tokens: list[int], offer: dict) -> Claim | None:
        """On the engine's thread: room for the offered pages this cache lacks, with what it
        holds of the prompt locked until ``commit`` (the read runs between, off the
        engine's thread, while passes go on). None when nothing must move or no room can be
        made."""
        n = int(offer["tokens"])
        have, node = self.cache.match_prefix(tokens[:n])
        remote, stamps = offer["pages"][len(have) :], offer["stamps"][len(have) :]
        if not remote:
            return None
        self.cache.lock(node)  # what it holds already must not be evicted meanwhile
        new = self._alloc(len(remote))
        if new is None:
            self.cache.unlock(node)
            return None
        return Claim(tokens[:n], have, node, remote, stamps, new)

    def commit(self, claim: Claim, result: TransferResult) -> int:
        """On the engine's thread, after the read: cache what arrived (or free it all when
        the read failed, but for the pages a read still in flight may write: the transport
        hands those back once it has ended); the tokens received."""
        self.cache.unlock(claim.node)
        if not result.ok:
            held = set(result.held)
            self.blocks.free([p for p in claim.new if p not in held])
            return 0
        kept, _ = self.cache.insert(claim.tokens, claim.have + claim.new)
        kept = set(kept)
        self.blocks.free([p for p in claim.new if p not in kept])
        return len(claim.new) * self.pool.page_size

    def _alloc(self, count: int) -> list[int] | None:
        short = count - self.pool.num_free
        if short > 0:
            if short > self.cache.num_evictable_pages:
                return None
            self.blocks.free(self.cache.evict(short))
            device = self.pool.k_cache.device
            if self.cache.host is not None and device.type == "cuda":  # the copies down, before the read
                torch.cuda.current_stream(device).synchronize()
        return self.pool.alloc(count) if count <= self.pool.num_free else None
