"""The processes of a tensor-parallel engine. Rank 0 is the engine's own process: its
scheduler, radix cache, block tables and sampler decide each iteration once. Ranks 1 to
N-1 are processes started here that follow it, as vLLM's and SGLang's workers follow
their scheduler: each holds its slice of the model and of the KV pool, receives each
iteration's inputs by broadcast, and runs the same forward pass; the all-reduces inside
it are the only other traffic. Built on ``torch.distributed``: gloo on CPU, NCCL on GPUs.

A follower that dies makes rank 0's next collective fail (gloo) or time out (``timeout_s``)
rather than hang forever; its engine then fails as a whole, and the process that owns it
restarts it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import pickle
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def check_devices(device: str, size: int) -> None:
    """Refuse, by name, ranks this host cannot hold."""
    if device.startswith("cuda"):
        first, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if first + size > count:
            raise ValueError(f"tensor_parallel_size={size} is invalid on {device}: its ranks need GPUs "
                             f"{first} to {first + size - 1}, and this host has {count}")  # fmt: skip
    elif not dist.is_gloo_available():
        raise ValueError(f"tensor_parallel_size={size} is invalid on the CPU: this torch has no gloo backend")


class RankLost(RuntimeError):
    """A follower rank died: the engine cannot run another pass and must be rebuilt."""


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the next GPUs after the engine's own (``cuda:2`` at TP 2
    puts rank 1 on ``cuda:3``); the CPU for every rank of a CPU engine."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


class Group:
    """One engine's process group, a group of its own rather than torch.distributed's
    default one: a process may hold several engines, and an engine may be rebuilt in the
    process that held it. ``store``: the group's rendezvous, rank 0's own
    (``rendezvous_store``) or joined at its port (``rank_transport.join_store``)."""

    def __init__(self, rank: int, size: int, store: dist.TCPStore, device: str, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size = rank, size
        self.store = store
        if device.startswith("cuda"):
            self.device = torch.device(rank_device(device, rank))
            torch.cuda.set_device(self.device)
            self.pg = dist.ProcessGroupNCCL(self.store, rank, size)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(self.store, rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        self.pg.allreduce([x]).wait()
        return x

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self.device)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([moved], options).wait()
        return moved.cpu()

    def send(self, message: object) -> None:
        """Rank 0: ``message`` to every other rank (pickled, as its length then its bytes)."""
        data = pickle.dumps(message)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> object:
        """A follower: rank 0's next message."""
        size = int(self._broadcast(torch.zeros(1, dtype=torch.int64)).item())
        return pickle.loads(self._broadcast(torch.empty(size, dtype=torch.uint8)).numpy().tobytes())


class Ranks:
    """Rank 0's view: the followers started (each running ``follow(rank, size, port,
    *args)`` in a process of its own), this process joined as rank 0."""

    def __init__(self, size: int, device: str, follow: Callable, args: tuple,
                 timeout_s: float = 120.0) -> None:  # fmt: skip
        self.closed = False
        store = rendezvous_store(size, timeout_s)  # also the KV slices' channel
        self.port = port = store.port
        context = multiprocessing.get_context("spawn")
        context.set_executable(_python())  # inside Triton's stub, sys.executable is not python
        self.processes = [context.Process(target=follow, args=(rank, size, port, *args), daemon=True,
                                          name=f"preble-tp-{rank}") for rank in range(1, size)]  # fmt: skip
        for process in self.processes:
            process.start()
        self.group = Group(0, size, store, device, timeout_s)

    def send(self, message: object) -> None:
        self.group.send(message)

    def lost(self) -> str | None:
        """Which follower has exited, if one has (after a failed collective: give it a
        moment to be reaped)."""
        for process in self.processes:
            process.join(timeout=0.5 if process.is_alive() else 0)
            if not process.is_alive():
                return f"tensor-parallel rank {process.name.rsplit('-', 1)[1]} exited ({process.exitcode})"
        return None

    def close(self) -> None:
        """Tell the followers to stop, wait for them (once); a broken group is not told."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.lost() is None:
                self.send(None)
        finally:
            for process in self.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()


def rendezvous_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, bound before any follower starts, on a port the OS picks: a port
    found free and bound later can be taken in between (by another engine's gloo pairs),
    and a follower then talks to a stranger."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def _python() -> str:
    """This environment's interpreter, also where ``sys.executable`` is Triton's stub."""
    for exe in (Path(sys.executable), Path(sys.prefix) / "bin" / "python3"):
        if exe.name.startswith("python") and exe.exists():
            return str(exe)
    return shutil.which("python3") or "python3"
