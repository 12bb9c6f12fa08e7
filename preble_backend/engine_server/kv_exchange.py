"""An engine's side of prefill/decode disaggregation, between its Triton model and its cache.

- A **prefill** engine answers a prefill leg (one token) and, on its final response,
  offers the prompt's cached pages under a lease named by the leg (``offer``): the page
  numbers, their stamps and its NIXL agent's metadata, which travel to the decode engine
  through the router, over the engines' own authenticated gRPC channel (never an open
  port). A decode side's notice releases the lease; else it expires after ``kv_lease_s``.
- A **decode** engine given that offer with a request (``take``) reserves room for the
  pages its own cache lacks on the engine's thread, reads them on a thread of its own
  (passes go on meanwhile), caches them on the engine's thread, tells the prefill side it
  is done, and only then queues the request, whose prefix is now cached. Whatever fails
  (the prefill side died, stalled past the timeout, or freed a page while it was read),
  the pages are freed and the request prefills here, with the same answer: nothing waits
  longer than the transfer's timeout, nothing is decoded from a stale page.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from preble_backend.engine.engine import Engine
from preble_backend.engine.scheduling.handoff import Handoff
from preble_backend.kv_transfer.nixl_transport import KVTransport, TransferResult
from preble_backend.kv_transfer.rank_transport import RankTransport


def transport_for(engine: Engine, name: str, **callbacks) -> KVTransport | RankTransport:
    """The engine's NIXL transport: its pool's, or at tensor parallelism each rank's slice
    (the followers are told on the engine's thread, between passes)."""
    cfg = engine.config
    port = engine.run_in_loop(
        lambda: engine.runner.move_kv_slices(name, cfg.kv_transfer_lanes, cfg.kv_transfer_devices)
    ).result()
    if port is None:
        return KVTransport(name, engine.pool, cfg.kv_transfer_lanes, net_devices=cfg.kv_transfer_devices,
                           **callbacks)  # fmt: skip
    return RankTransport(name, engine.pool, port, cfg.tensor_parallel_size, cfg.kv_transfer_lanes,
                         net_devices=cfg.kv_transfer_devices, **callbacks)  # fmt: skip


class KVExchange:
    def __init__(self, engine: Engine, name: str, log: Callable[[str], None]) -> None:
        cfg = engine.config
        self.engine, self.log = engine, log
        self.handoff = Handoff(engine.scheduler.blocks, ttl_s=cfg.kv_lease_s)
        self.transport = transport_for(engine, name, on_notice=self._notice, on_settled=self._settled)
        self.reads = ThreadPoolExecutor(1, thread_name_prefix="preble-kv-read")
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("kv_offers", "kv_takes", "kv_transfer_failures", "kv_pages_received",
                                     "kv_bytes_received", "kv_transfer_s"), 0)  # fmt: skip

    def stats(self) -> dict:
        """What the router learns of this engine's KV moves: its role, the bytes a token's KV
        takes (what a transfer costs), and what it has moved, with the bandwidth seen."""
        lay = self.transport.layout
        with self._lock:
            moved = dict(self.counts)
        seconds = moved["kv_transfer_s"]
        gbps = moved["kv_bytes_received"] / seconds / 1e9 if seconds else 0.0
        ranks = self.transport.ranks  # each holds a slice of every page
        per_token = 2 * lay.num_layers * lay.page_bytes // lay.page_size * ranks
        return {**moved, "kv_transfer_gbps": round(gbps, 3), "kv_leases": len(self.handoff.leases),
                "kv_pages_held": self.transport.held_pages, "kv_ranks": ranks,
                "kv_bytes_per_token": per_token}  # fmt: skip

    def offer(self, lease_id: str, tokens: list[int]) -> dict:
        """On the engine's thread, once the prefill leg has finished (its pages are cached);
        leases past their time go first (``sweep`` may not run while responses stream)."""
        self.handoff.expire()
        with self._lock:
            self.counts["kv_offers"] += 1
        return {**self.handoff.offer(lease_id, tokens), "peer": self.transport.offer()}

    def sweep(self) -> None:
        """Any thread, often: leases past their time are released on the engine's thread."""
        if self.handoff.leases:
            self.engine.run_in_loop(self.handoff.expire)

    def _notice(self, lease_id: str) -> None:
        """The poller's thread: a decode side is done with a lease."""
        self.engine.run_in_loop(lambda: self.handoff.release(lease_id))

    def _settled(self, pages: list[int]) -> None:
        """The poller's thread: a timed-out read has ended; the pages it held are free again."""
        self.engine.run_in_loop(lambda: self.handoff.blocks.free(pages))

    def take(self, tokens: list[int], offer: dict, then: Callable[[], None]) -> None:
        """Receive what ``offer`` holds that this cache lacks, then call ``then`` on the
        engine's thread, whether or not anything was received."""

        def reserve() -> None:
            try:
                claim = self.handoff.reserve(tokens, offer)
            except Exception as exc:  # a malformed offer: prefill here
                self.log(f"KV offer refused ({exc}); prefilling here")
                claim = None
            if claim is None:
                self.decline(offer)  # off the engine's thread: a read may hold the transport
                then()
                return
            self.reads.submit(read, claim)

        def read(claim) -> None:
            peer = None
            try:
                peer = self.transport.connect(offer["peer"])
                timeout_s = self.engine.config.kv_transfer_timeout_s
                result = self.transport.read(peer, claim.remote, claim.stamps, claim.new, timeout_s)
            except Exception as exc:
                result = TransferResult(False, 0, 0, 0.0, 0, [], f"{type(exc).__name__}: {exc}")
            if peer is not None and self.transport.connected(peer):  # else it failed the read: gone
                self._release(offer)
            self.engine.run_in_loop(lambda: commit(claim, result))

        def commit(claim, result: TransferResult) -> None:
            self.handoff.commit(claim, result)
            with self._lock:
                self.counts["kv_takes"] += 1
                if result.ok:
                    self.counts["kv_pages_received"] += result.pages
                    self.counts["kv_bytes_received"] += result.bytes
                    self.counts["kv_transfer_s"] += result.seconds
                else:
                    self.counts["kv_transfer_failures"] += 1
            if not result.ok:
                self.log(
                    f"KV transfer from {offer['peer'].get('name')} failed ({result.error}); prefilling here"
                )
            then()

        self.engine.run_in_loop(reserve)

    def decline(self, offer: dict) -> None:
        """The request will not run here: release its lease on the prefill side (off the
        caller's thread: connecting to a peer for the first time takes a moment)."""
        self.reads.submit(self._release, offer)

    def _release(self, offer: dict) -> None:
        """Tell the prefill side its lease may go (it expires there anyway if this fails)."""
        try:
            peer = self.transport.connect(offer["peer"])
            self.transport.notify(peer, str(offer["lease"]))
        except Exception as exc:
            self.log(f"could not release KV lease {offer.get('lease')!r} ({exc}); it expires there")

    def close(self) -> None:
        self.reads.shutdown(wait=True)
        self.transport.close()
