"""KV transfer between tensor-parallel engines: each rank moves its own slice.

A TP engine's KV pool is cut by KV heads across its ranks, each in a process of its own
(``engine/runners/tp_ranks.py``), so no one process can read a whole page. Every rank
holds its own NIXL agents over its own slice, and rank ``r`` of the decode engine reads
from rank ``r`` of the prefill engine: the same head split on both sides, so the prefill
and decode engines must have the same tensor-parallel size and KV shape (refused by name
otherwise). Rank 0 decides everything, as it does for a forward pass; the followers only
read, in parallel with it.

**The channel to the followers** is the engine's own rendezvous store (a loopback TCP
store that rank 0 hosts), not the broadcast its passes use: a read runs beside passes,
on a thread of its own, and may not wait for the engine's thread. Keys, per follower
``r`` and read ``n``: ``kv/offer/r`` (its agents' metadata, once), ``kv/read/r/n`` (what to
read), ``kv/done/r/n`` (its result), ``kv/free/r/n`` (its pages can no longer be written:
at once, or when a late read has ended).

**Stamps are checked once, last.** Only rank 0 frees pages, and it bumps a page's stamp
before any pass (on any rank) can reuse it, so rank 0 reads the prefill side's stamps
after every rank's read has ended: a match proves no rank's slice was reused while read.

**Held pages.** A page is out of use until every rank that read into it has said its
read can no longer write (``kv/free``, or rank 0's own transport settling); then
``on_settled`` hands it back, as for one rank.
"""

from __future__ import annotations

import datetime
import itertools
import json
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from preble_backend.kv_transfer.nixl_transport import LATE, KVTransport, TransferResult, freed_while_read
from preble_backend.model.kv_pool import KVPool

_POLL_S = 0.002  # how often rank 0 looks for its followers' answers
_GRACE_S = 2.0  # a follower's read ends within its timeout and about a second of settling


def join_store(port: int, timeout_s: float) -> dist.TCPStore:
    """A client of rank 0's rendezvous store (``tp_ranks.rendezvous_store``): a follower
    rank's group joins it, and the KV slices' channel runs through it."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def follower_reads(rank: int, port: int, pool: KVPool, name: str, lanes: int, net_devices: str,
                   at: list[str]) -> None:  # fmt: skip
    """A follower's side, on a thread of its own: publish its slice, then serve rank 0's
    reads in order until an order says stop (``stop_follower``) or rank 0's store goes
    away. ``at[0]``: the key of the order it waits for."""
    lock = threading.Lock()  # ``waiting`` and ``early``, shared with the transport's poller
    # two clients: one waiting for an order blocks any other use of it
    store, answers = join_store(port, 60.0), join_store(port, 60.0)
    waiting: dict[tuple[int, ...], int] = {}  # held pages -> the read that holds them
    early: set[tuple[int, ...]] = set()  # held pages that settled before their read returned

    def settled(pages: list[int]) -> None:
        with lock:
            if tuple(pages) in waiting:
                answers.set(f"kv/free/{rank}/{waiting.pop(tuple(pages))}", b"1")
            else:
                early.add(tuple(pages))

    try:
        transport = KVTransport(f"{name}-rank{rank}", pool, lanes, net_devices=net_devices,
                                on_settled=settled)  # fmt: skip
    except Exception as exc:  # rank 0 names it, rather than waiting for an offer that never comes
        store.set(f"kv/offer/{rank}", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    store.set(f"kv/offer/{rank}", json.dumps(transport.offer()))
    try:
        for n in itertools.count():
            at[0] = key = f"kv/read/{rank}/{n}"
            while True:
                try:
                    store.wait([key], datetime.timedelta(hours=1))
                    break
                except Exception as exc:  # torch's store error: a timeout, or rank 0 gone
                    if "timeout" not in str(exc).lower():
                        return
            order = json.loads(store.get(key))
            store.delete_key(key)
            if order is None:
                return
            try:
                peer = transport.connect(order["peer"])
                result = transport.read(peer, order["remote"], None, order["local"], order["timeout_s"])
            except Exception as exc:  # a peer it cannot learn: rank 0 prefills instead
                result = TransferResult(False, 0, 0, 0.0, 0, [], f"{type(exc).__name__}: {exc}")
            with lock:
                if result.held and tuple(result.held) not in early:
                    waiting[tuple(result.held)] = n
                else:
                    early.discard(tuple(result.held))
                    answers.set(f"kv/free/{rank}/{n}", b"1")
                answer = {k: getattr(result, k) for k in ("ok", "bytes", "descriptors", "error")}
                answers.set(f"kv/done/{rank}/{n}", json.dumps(answer))
    finally:
        transport.close()


def stop_follower(port: int, at: list[str]) -> None:
    """Wake a follower's ``follower_reads`` with the order to stop."""
    join_store(port, 5.0).set(at[0], "null")


class RankTransport:
    """Rank 0's side, with ``KVTransport``'s interface: its own slice moved by a
    ``KVTransport``, its followers' by their own (``follower_reads``), one result."""

    def __init__(self, name: str, pool: KVPool, port: int, ranks: int, lanes: int = 2,
                 on_notice: Callable[[str], None] | None = None, net_devices: str = "lo",
                 on_settled: Callable[[list[int]], None] | None = None,
                 timeout_s: float = 120.0) -> None:  # fmt: skip
        """Call once the followers were told to start theirs; waits for their offers."""
        self.own = KVTransport(name, pool, lanes, on_notice=on_notice, net_devices=net_devices,
                               on_settled=self._own_settled)  # fmt: skip
        self.name, self.layout, self.ranks = self.own.name, self.own.layout, ranks
        self.on_settled = on_settled
        self._store = join_store(port, timeout_s)
        followers = [f"kv/offer/{r}" for r in range(1, ranks)]
        self._store.wait(followers, datetime.timedelta(seconds=timeout_s))
        self._offers = [json.loads(self._store.get(key)) for key in followers]
        for r, offer in enumerate(self._offers, start=1):
            if "error" in offer:
                self.own.close()
                raise RuntimeError(f"tensor-parallel rank {r} cannot move KV: {offer['error']}")
        self._peers: dict[str, list[dict]] = {}  # a peer's followers' offers
        self._reads = itertools.count()
        self._read_lock = threading.Lock()  # one read at a time: the followers serve them in order
        self._lock = threading.Lock()  # the store client and ``_held``
        self._held: dict[int, tuple[list[int], set[int]]] = {}  # read -> (its pages, ranks not done)
        self._early: set[tuple[int, ...]] = set()  # rank 0's held pages that settled before ``_hold``
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"kv-ranks-{self.name}")
        self._watcher.start()

    def offer(self) -> dict:
        return {**self.own.offer(), "ranks": self._offers}

    def connect(self, offer: dict) -> str:
        theirs = offer.get("ranks", [])
        if len(theirs) != len(self._offers):
            there = len(theirs) + 1
            raise ValueError(f"cannot move KV between {self.name} and {offer.get('name')}: "
                             f"tensor_parallel_size differs: {self.ranks} here, {there} there")  # fmt: skip
        peer = self.own.connect({**offer, "ranks": []})
        self._peers[peer] = theirs
        return peer

    def connected(self, peer: str) -> bool:
        return self.own.connected(peer)

    def notify(self, peer: str, notice: str) -> bool:
        return self.own.notify(peer, notice)

    @property
    def held_pages(self) -> int:
        with self._lock:
            return sum(len(pages) for pages, _ in self._held.values())

    def read(self, peer: str, remote_pages: list[int], stamps: list[int], local_pages: list[int],
             timeout_s: float = 5.0) -> TransferResult:  # fmt: skip
        """Every rank's slice of ``remote_pages`` into ``local_pages``, then the stamps;
        within ``timeout_s`` and a grace for the followers to answer."""
        start = time.perf_counter()
        with self._read_lock:
            n = next(self._reads)
            with self._lock:
                for r, offer in enumerate(self._peers[peer], start=1):
                    order = {"peer": offer, "remote": remote_pages, "local": local_pages}
                    self._store.set(f"kv/read/{r}/{n}", json.dumps({**order, "timeout_s": timeout_s}))
            own = self.own.read(peer, remote_pages, None, local_pages, timeout_s)
            answers = self._answers(n, start + timeout_s + _GRACE_S)
            error = own.error or next((a["error"] or LATE for a in answers if not a["ok"]), "")
            stale: list[int] = []
            if not error and remote_pages:
                error, stale = self.own.check_stamps(peer, remote_pages, stamps, timeout_s)
                error = error or freed_while_read(stale, remote_pages, peer)
            held = self._hold(n, local_pages, own.held)
        return TransferResult(
            not error, len(remote_pages), own.bytes + sum(a["bytes"] for a in answers),
            time.perf_counter() - start, own.descriptors + sum(a["descriptors"] for a in answers),
            stale, error, held,
        )  # fmt: skip

    def _answers(self, n: int, deadline: float) -> list[dict]:
        """Each follower's result of read ``n``; one that has not answered by ``deadline``
        failed it (its pages stay held until it says they are free)."""
        answers = {}
        while len(answers) < self.ranks - 1 and time.perf_counter() < deadline:
            with self._lock:
                for r in range(1, self.ranks):
                    key = f"kv/done/{r}/{n}"
                    if r not in answers and self._store.check([key]):
                        answers[r] = json.loads(self._store.get(key))
                        self._store.delete_key(key)
            time.sleep(_POLL_S)
        none = {"ok": False, "bytes": 0, "descriptors": 0, "error": LATE}
        return [answers.get(r, none) for r in range(1, self.ranks)]

    def _hold(self, n: int, pages: list[int], own_held: list[int]) -> list[int]:
        """The local pages some rank's read may still write: all of them, or none."""
        with self._lock:
            pending = {r for r in range(1, self.ranks) if not self._freed(r, n)}
            if own_held and tuple(own_held) not in self._early:
                pending.add(0)
            self._early.discard(tuple(own_held))
            if not pending:
                return []
            self._held[n] = (list(pages), pending)
            return list(pages)

    def _freed(self, rank: int, n: int) -> bool:
        """Under the lock: follower ``rank`` has said read ``n`` can no longer write."""
        key = f"kv/free/{rank}/{n}"
        if not self._store.check([key]):
            return False
        self._store.delete_key(key)
        return True

    def _own_settled(self, pages: list[int]) -> None:
        with self._lock:
            n = next((n for n, (held, ranks) in self._held.items() if held == pages and 0 in ranks), None)
            if n is None:
                self._early.add(tuple(pages))  # its read has not returned yet (``_hold``)
                return
        self._settle(n, 0)

    def _settle(self, n: int, rank: int) -> None:
        """Rank ``rank``'s read ``n`` can no longer write; its pages go back once no rank's can."""
        with self._lock:
            pages, ranks = self._held.get(n, ([], set()))
            ranks.discard(rank)
            if ranks or n not in self._held:
                return
            del self._held[n]
        if self.on_settled is not None:
            self.on_settled(pages)

    def _watch(self) -> None:
        """Hand back held pages as the followers free them."""
        while not self._stop.wait(0.05):
            with self._lock:
                held = [(n, r) for n, (_, ranks) in self._held.items() for r in ranks if r]
                done = [(n, r) for n, r in held if self._freed(r, n)]
            for n, r in done:
                self._settle(n, r)

    def close(self) -> None:
        with self._read_lock, self._lock:
            n = next(self._reads)
            for r in range(1, self.ranks):
                self._store.set(f"kv/read/{r}/{n}", "null")
        self._stop.set()
        self._watcher.join()
        self.own.close()
