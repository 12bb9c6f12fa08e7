"""One engine's side of KV transfer over NIXL.

**Pull, not push.** The decode engine reads the pages it lacks from the prefill engine's
pool into pages it has just allocated. Push (the prefill side writing into pages the
decode side reserved) saves one round trip, but it needs those pages reserved before the
prefill ends, for a decode placement that may still change, and a failed push leaves the
decode side holding pages it cannot trust. With pull, the side that will decode from the
pages decides what it lacks (its own radix cache may hold part of the prompt), checks what
it read, and frees its own pages on any failure; the prefill side only holds a lease.

**Stamps, not trust.** A read is offered pages with their generation stamps
(``KVPool.stamps``). After the pages arrive, the reader reads the stamps again: a page the
prefill side freed since the offer (its lease ended, an eviction) no longer matches, and
the read is reported stale and must not be decoded from. The prefill side bumps a page's
stamp when it frees it, before any reuse can write into it, so a matching stamp read after
the data proves no reuse had begun while the data was read.

**Lanes.** On this host, NIXL's UCX backend reads another process's memory with CMA
(``process_vm_readv``), one thread per agent, at about a third of a memcpy; several agents
(lanes), each reading a share from its own thread, run in parallel. Agents run without
NIXL's progress thread, which spins a core; the passive side progresses every few
milliseconds from a thread of its own (connection wire-up needs it; reads do not).

**A read that times out still owns its pages.** A posted read cannot be called back: over
UCX's TCP transport a read whose peer stalled lands when the peer runs again, even after
NIXL reported the handle released and the peer removed (measured, tests/test_kv_transfer.py).
So pages (and the stamps buffer) that a read still in flight may write are *held*: the
failed result names them, the caller keeps them out of use, and the poller hands them
back (``on_settled``) once every handle of that read has ended.
"""

from __future__ import annotations

import base64
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from preble_backend.kv_transfer.layout import PoolLayout, page_runs, stamp_rows
from preble_backend.model.kv_pool import KVPool

LATE = "the transfer did not finish in time"  # a stalled peer: kept, it may answer later
_SETTLE_ROUNDS = 25  # progress calls before an agent is destroyed (~50 ms)


def load_nixl():
    """NIXL's Python API, or an error that says how to get it."""
    try:
        import nixl_cu12 as nixl
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise RuntimeError("KV transfer needs NIXL: pip install 'preble-triton[pd]'") from e
    return nixl


@dataclass
class TransferResult:
    ok: bool
    pages: int
    bytes: int
    seconds: float
    descriptors: int
    stale: list[int]  # offered pages whose stamp changed while they were read
    error: str = ""
    held: list[int] = field(default_factory=list)  # local pages a read in flight may still write


@dataclass
class _LateRead:
    """A failed read that may still write: its handles, its lanes' threads, what it may write."""

    handles: list[tuple]  # (agent, handle)
    threads: list[threading.Thread]
    pages: list[int]
    scratch: tuple | None = None  # (the stamps buffer it may write, its registration)


class KVTransport:
    """``lanes`` NIXL agents over one pool; ``offer`` is what a peer needs to read from it."""

    ranks = 1  # its pool is every page whole (``RankTransport``: one slice per rank)

    def __init__(self, name: str, pool: KVPool, lanes: int = 2, passive_poll_s: float = 0.005,
                 on_notice: Callable[[str], None] | None = None,
                 net_devices: str = "lo",
                 on_settled: Callable[[list[int]], None] | None = None) -> None:  # fmt: skip
        """``on_notice`` is called, on the poller's thread, with each notice a peer sends
        (``notify``): how a decode side says it is done with an offer. ``net_devices``: what
        UCX may listen and connect on; by default loopback only (UCX otherwise listens on
        every interface the host has, which nobody asked for). ``on_settled`` is called, on
        the poller's thread, with the held pages of a failed read once it can no longer
        write them."""
        os.environ["UCX_NET_DEVICES"] = net_devices  # read when the agents' UCX contexts start
        nixl = load_nixl()
        self.on_notice, self.on_settled = on_notice, on_settled
        self._late: list[_LateRead] = []
        self.name = f"{name}-{uuid.uuid4().hex[:12]}"  # a restarted engine is a new peer, never the dead one
        self.pool = pool
        self.layout = PoolLayout.of(pool)
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agents = [nixl.nixl_agent(f"{self.name}/{i}", config) for i in range(max(1, lanes))]
        regions = self._regions()
        for agent in self.agents:
            for memory, rows in regions.items():
                agent.register_memory(rows, memory)
        self._scratch, self._scratch_reg = self._new_scratch()  # stamps read back
        self._peers: dict[str, tuple[list[str], PoolLayout]] = {}
        self._lock = threading.Lock()  # one user of the agents at a time: a read, or the poller
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._progress, args=(passive_poll_s,), daemon=True,
                                        name=f"nixl-progress-{self.name}")  # fmt: skip
        self._poller.start()

    def _regions(self) -> dict[str, list[tuple[int, int, int, str]]]:
        lay, pool = self.layout, self.pool
        size = pool.k_cache.numel() * pool.k_cache.element_size()
        data = [(lay.k_address, size, lay.device_id, ""), (lay.v_address, size, lay.device_id, "")]
        stamps = [(lay.stamps_address, pool.stamps.nbytes, 0, "")]
        if lay.memory == "DRAM":
            return {"DRAM": data + stamps}
        return {lay.memory: data, "DRAM": stamps}

    def _progress(self, every_s: float) -> None:
        """Progress the agents while no read does: an agent (thread sync NONE, the mode
        without locks) must never be driven from two threads at once."""
        while not self._stop.wait(every_s):
            if self._lock.acquire(blocking=False):
                try:
                    notices = [
                        n for agent in self.agents for ns in agent.get_new_notifs().values() for n in ns
                    ]
                    settled = self._reap()
                finally:
                    self._lock.release()
                for notice in notices:
                    if self.on_notice is not None:
                        self.on_notice(notice.decode(errors="replace"))
                for pages in settled:
                    if self.on_settled is not None:
                        self.on_settled(pages)

    def _new_scratch(self) -> tuple[np.ndarray, object]:
        scratch = np.zeros(self.pool.num_pages, dtype=np.int64)
        return scratch, self.agents[0].register_memory([(scratch.ctypes.data, scratch.nbytes, 0, "")], "DRAM")

    def _reap(self) -> list[list[int]]:
        """Under the lock: the held pages of every late read that can no longer write."""
        settled, waiting = [], []
        for late in self._late:
            if any(t.is_alive() for t in late.threads) or any(_in_flight(a, h) for a, h in late.handles):
                waiting.append(late)
                continue
            for agent, handle in late.handles:
                _release(agent, handle)
            if late.scratch is not None:
                self.agents[0].deregister_memory(late.scratch[1])
            settled.append(late.pages)
        self._late = waiting
        return settled

    @property
    def held_pages(self) -> int:
        return sum(len(late.pages) for late in self._late)

    def offer(self) -> dict:
        """What a peer needs to read this pool: JSON-safe, sent over the engines' own
        authenticated channel (never an open port)."""
        return {
            "name": self.name,
            "agents": [base64.b64encode(a.get_agent_metadata()).decode() for a in self.agents],
            "layout": self.layout.to_json(),
        }

    def connect(self, offer: dict) -> str:
        """Learn a peer from its ``offer``; returns its name. Every lane talks to the
        peer's first agent."""
        peer, layout = offer["name"], PoolLayout.from_json(offer["layout"])
        if offer.get("ranks"):  # its pool holds one rank's slice of each page (``rank_transport``)
            raise ValueError(f"cannot move KV between {self.name} and {peer}: tensor_parallel_size "
                             f"differs: 1 here, {len(offer['ranks']) + 1} there")  # fmt: skip
        why = self.layout.mismatch(layout)
        if why:
            raise ValueError(f"cannot move KV between {self.name} and {peer}: {why}")
        if peer in self._peers:
            return peer
        metadata = base64.b64decode(offer["agents"][0])
        with self._lock:
            names = [agent.add_remote_agent(metadata) for agent in self.agents]
        self._peers[peer] = (names, layout)
        return peer

    def notify(self, peer: str, notice: str) -> bool:
        """Send ``notice`` to ``peer``'s ``on_notice``; False where it cannot be sent (the
        peer is gone: its lease then expires on its own)."""
        names, _ = self._peers[peer]
        with self._lock:
            try:
                self.agents[0].send_notif(names[0], notice.encode())
                return True
            except Exception:  # nixl raises its own errors for a peer that is gone
                self.disconnect(peer)
                return False

    def connected(self, peer: str) -> bool:
        return peer in self._peers

    def disconnect(self, peer: str) -> None:
        names, _ = self._peers.pop(peer, ([], None))
        for agent, name in zip(self.agents, names):
            try:
                agent.remove_remote_agent(name)
            except Exception:  # nixl's own error for a peer it no longer holds: forgotten either way
                pass

    def read(self, peer: str, remote_pages: list[int], stamps: list[int] | None, local_pages: list[int],
             timeout_s: float = 5.0) -> TransferResult:  # fmt: skip
        """Read ``remote_pages`` of ``peer`` (offered with ``stamps``) into ``local_pages``
        of this pool. Never raises for the peer's failures: a dead, stalled or stale peer
        is a result with ``ok`` false, within ``timeout_s``. ``stamps`` None: the pages
        are not checked here (a tensor-parallel rank's slice: rank 0 checks them once every
        rank's read has ended, ``check_stamps``)."""
        names, remote = self._peers[peer]
        src_runs, dst_runs = page_runs(remote_pages, local_pages)
        src, dst = remote.page_descriptors(src_runs), self.layout.page_descriptors(dst_runs)
        start = time.perf_counter()
        deadline = start + timeout_s
        nbytes = int(src[:, 1].sum()) if len(src) else 0
        late, stamps_late, threads = [], [], []
        with self._lock:
            error = self._read_lanes(names, remote.memory, src, dst, deadline, late, threads)
            stale: list[int] = []
            if not error and remote_pages and stamps is not None:
                error, stale = self._stale(names[0], remote, remote_pages, stamps, deadline, stamps_late)
            held = self._hold(late, stamps_late, threads, local_pages)
            if error and error != LATE and not (late or stamps_late):  # the peer failed it (gone,
                self.disconnect(peer)  # most likely): forget it; a live one is learnt again (``connect``)
        seconds = time.perf_counter() - start
        ok = not error and not stale
        error = error or freed_while_read(stale, remote_pages, peer)
        return TransferResult(ok, len(remote_pages), nbytes, seconds, len(src), stale, error, held)

    def check_stamps(self, peer: str, pages: list[int], stamps: list[int],
                     timeout_s: float = 5.0) -> tuple[str, list[int]]:  # fmt: skip
        """Read ``peer``'s stamps of ``pages`` again: (an error, or an empty string; the
        pages whose stamp is no longer the one offered)."""
        names, remote = self._peers[peer]
        late: list = []
        with self._lock:
            error, stale = self._stale(names[0], remote, pages, stamps, time.perf_counter() + timeout_s, late)
            self._hold([], late, [], [])
        return error, stale

    def _stale(self, name: str, remote: PoolLayout, pages: list[int], stamps: list[int], deadline: float,
               late: list) -> tuple[str, list[int]]:  # fmt: skip
        error = self._read_stamps(name, remote, pages, deadline, late)
        got = self._scratch[: len(pages)]
        return error, [] if error else [p for p, s, g in zip(pages, stamps, got) if s != g]

    def _hold(self, late: list, stamps_late: list, threads: list, pages: list[int]) -> list[int]:
        """Under the lock: keep what a read still in flight may write out of use; the pages
        it holds (none when every handle ended)."""
        lanes_late = late or any(t.is_alive() for t in threads)
        if not lanes_late and not stamps_late:
            return []
        scratch = None
        if stamps_late:  # the stamps buffer may still be written: read the next stamps elsewhere
            scratch = (self._scratch, self._scratch_reg)
            self._scratch, self._scratch_reg = self._new_scratch()
        held = list(pages) if lanes_late else []
        self._late.append(_LateRead(late + stamps_late, list(threads), held, scratch))
        return held

    def _read_lanes(self, names: list[str], memory: str, src: np.ndarray, dst: np.ndarray,
                    deadline: float, late: list, threads: list) -> str:  # fmt: skip
        """Split the descriptors into one share per lane, by bytes, and read them in
        parallel; the first error, or an empty string."""
        if not len(src):
            return ""
        shares = _shares(src[:, 1], len(self.agents))
        errors: list[str] = []
        for agent, name, (lo, hi) in zip(self.agents, names, shares):
            if lo == hi:
                continue
            args = (agent, name, memory, self.layout.memory, src[lo:hi], dst[lo:hi], deadline, errors, late)
            threads.append(threading.Thread(target=_read, args=args, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()) + 1.0)
        if any(t.is_alive() for t in threads):
            return LATE
        return errors[0] if errors else ""

    def _read_stamps(
        self, name: str, remote: PoolLayout, pages: list[int], deadline: float, late: list
    ) -> str:
        src, dst = remote.stamp_descriptors(pages), stamp_rows(self._scratch.ctypes.data, range(len(pages)))
        self._scratch[: len(pages)] = -1
        errors: list[str] = []
        _read(self.agents[0], name, "DRAM", "DRAM", src, dst, deadline, errors, late)
        return errors[0] if errors else ""

    def close(self) -> None:
        """Disconnect every peer, then progress until UCX has failed or finished what was
        in flight to them: an agent destroyed with requests still queued to a dead peer
        aborts the process (UCX asserts its queues are empty)."""
        self._stop.set()
        self._poller.join()
        with self._lock:
            for peer in list(self._peers):
                self.disconnect(peer)
            for _ in range(_SETTLE_ROUNDS):
                for agent in self.agents:
                    agent.get_new_notifs()
                time.sleep(0.002)


def freed_while_read(stale: list[int], pages: list[int], peer: str) -> str:
    """The error of a read whose stamps found ``stale`` pages freed ("" when none were)."""
    return f"{len(stale)} of {len(pages)} pages were freed on {peer} while read" if stale else ""


def _shares(sizes: np.ndarray, lanes: int) -> list[tuple[int, int]]:
    """Cut descriptor rows into ``lanes`` contiguous shares of about equal bytes."""
    cumulative = np.cumsum(sizes.astype(np.float64))
    total = cumulative[-1]
    cuts = [0] + [int(np.searchsorted(cumulative, total * k / lanes)) for k in range(1, lanes)] + [len(sizes)]
    return list(itertools.pairwise(cuts))


def _read(agent, peer: str, remote_memory: str, local_memory: str, src: np.ndarray, dst: np.ndarray,
          deadline: float, errors: list[str], late: list) -> None:  # fmt: skip
    """One agent's READ of ``src`` (the peer's) into ``dst`` (ours), polled to the deadline."""
    handle, posted = None, False
    try:
        local = agent.get_xfer_descs(dst, local_memory)
        remote = agent.get_xfer_descs(src, remote_memory)
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        posted = True  # from here it may write, until its state says otherwise
        while state == "PROC":
            if time.perf_counter() > deadline:
                errors.append(LATE)
                return
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            errors.append(f"the transfer failed ({state})")
    except Exception as e:  # NIXL raises for a peer that went away
        errors.append(f"the transfer failed: {type(e).__name__}: {e}")
    finally:
        if handle is not None:
            _settle(agent, handle)
            if posted and _in_flight(agent, handle):  # never released while it may write: it is late
                late.append((agent, handle))
            else:
                _release(agent, handle)


def _in_flight(agent, handle) -> bool:
    """Whether the read may still write; an agent that cannot tell is taken to say yes."""
    try:
        return agent.check_xfer_state(handle) == "PROC"
    except Exception:
        return True


def _release(agent, handle) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # NIXL's own error for a handle it no longer holds: nothing to free
        pass


def _settle(agent, handle) -> None:
    """Progress a failed or abandoned request until UCX lets go of it (bounded)."""
    for _ in range(_SETTLE_ROUNDS):
        try:
            if agent.check_xfer_state(handle) != "PROC":
                return
        except Exception:
            return
        time.sleep(0.002)
