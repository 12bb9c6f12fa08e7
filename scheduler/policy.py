"""The global scheduler's policy interface and the simplest policies behind it.

A policy sees each request (its token ids and sampling parameters) and the router's load
view of every instance, and picks an instance. It hears back when a request finishes,
with the engine's report (cache events and a load snapshot), so prefix-aware policies can
mirror the engines' caches.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from scheduler.global_tree import GlobalPrefixTree


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    input_ids: list[int]
    params: SamplingParams
    # The prompt's page chain hashes by page size: filled where the request is tokenized
    # (or on first use), so routing never walks the tokens again.
    chains: dict[int, array] = field(default_factory=dict, compare=False, repr=False)

    def chain(self, page_size: int) -> array:
        chain = self.chains.get(page_size)
        if chain is None:
            chain = self.chains[page_size] = chain_hashes(self.input_ids, page_size)
        return chain


@dataclass(frozen=True, slots=True)
class Decision:
    instance: int  # where the request decodes (and prefills, unless ``prefill`` says elsewhere)
    branch: str  # which rule of the policy chose it (for metrics and tests)
    prefill: int | None = None  # disaggregated: the instance that prefills it (scheduler/disagg.py)


@dataclass(frozen=True)
class FinishInfo:
    """What the router learns when a request finishes on an instance."""

    events: list[CacheEvent] = field(default_factory=list)  # the engine's cache events
    load: dict = field(default_factory=dict)  # the engine's load snapshot
    ttft_s: float | None = None  # dispatch to first token, as the router saw it
    num_output_tokens: int = 0


@dataclass
class InstanceLoad:
    """What the router knows of one instance: its own in-flight requests, exact and
    immediate, and the engine's last reported snapshot, which covers other routers too."""

    in_flight: int = 0
    reported: dict = field(default_factory=dict)
    probed: dict = field(default_factory=dict)  # its last health answer: its role, KV and costs

    @property
    def queued(self) -> int:
        return int(self.reported.get("waiting", 0)) + int(self.reported.get("running", 0))


class Policy(ABC):
    name: str

    def __init__(self, num_instances: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_instances < 0:
            raise ValueError(f"num_instances={num_instances} is invalid: expected an integer >= 0")
        self.num_instances = num_instances  # slots: a router's engines that joined, departed ones too
        self.clock = clock  # the simulator passes its own
        self.live = set(range(num_instances))  # instances that take requests now

    @contextmanager
    def only(self, instances: set[int]):
        """Choose among ``instances`` alone meanwhile (a prefill/decode policy asks for an
        instance of one kind: ``scheduler/disagg.py``)."""
        live, self.live = self.live, instances
        try:
            yield
        finally:
            self.live = live

    @abstractmethod
    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        """Pick a live instance; the request is then dispatched there (and counted as such).
        The router asks only while at least one instance is live."""

    def place(self, request: RoutingRequest, instance: int) -> Decision:
        """Route the request to ``instance``, decided outside the policy (the later choices
        of an ``n`` > 1 request follow the first, whose prompt that engine now caches); the
        policy counts it as it counts its own decisions."""
        self.record(request, instance)
        return Decision(instance, "pinned")

    def record(self, request: RoutingRequest, instance: int) -> None:
        """Count a placement in the policy's state. Stateless policies keep none."""
        return None

    def add_instance(self) -> int:
        """An engine joined: a new slot for it, not live until ``instance_up`` (the router
        probes it first). A slot is never given to another engine, so nothing a departed
        engine left behind (a request still settling, a cache belief) can reach a new one."""
        instance = self.num_instances
        self.num_instances += 1
        self._grow()
        return instance

    def _grow(self) -> None:
        """Per-instance state for the slot ``add_instance`` made. Stateless policies keep none."""
        return None

    def withdraw(self, instance: int) -> None:
        """The engine is leaving: route nothing new to it, but keep believing what it
        caches while its requests finish (their reports still arrive); ``instance_down``
        once they have."""
        self.live.discard(instance)

    def instance_down(self, instance: int) -> None:
        """The instance died or cannot be reached: route around it and forget what it
        cached (an engine process that comes back starts with an empty cache)."""
        self.live.discard(instance)
        self.forget(instance)

    def instance_up(self, instance: int) -> None:
        self.live.add(instance)

    def forget(self, instance: int) -> None:
        """Drop what the policy believes ``instance`` caches. Stateless policies keep none."""
        return None

    def resync(self, instance: int) -> None:
        """The engine's cache events restart from a snapshot (a router's first report from
        it, or a cursor that fell off its log): what earlier events said it caches is
        replaced. Only policies that learn from events drop anything; one that tracks
        what it routed (SGLang's cache_aware) keeps its picture, as SGLang's router keeps a
        worker's tree until the worker is removed."""
        return None

    def learn(self, instance: int, load: dict) -> None:
        """An engine's load snapshot (its answer to a health probe, or the report on a final
        response): what it is, not only how busy. Policies that price no engine ignore it."""
        return None

    calibrating = False  # learns its engines' costs from their pass reports (E2, cost_model: auto)

    def calibrate(self, instance: int, load: dict) -> bool:
        """A health probe's answer, off the request path (the router's probe thread): what
        the engine serves and what its passes cost. True when what the policy prices the
        engine with, or why, changed. Policies that learn no cost model ignore it."""
        return False

    def cost_fits(self) -> list:
        """Per engine, the cost model it is priced with and why (``calibration.CostFit``);
        empty for policies that price no engine."""
        return []

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        """The request finished on ``instance``. Policies that keep no state ignore it."""
        return None

    def cached_tokens(self, instance: int) -> int | None:
        """What the policy believes ``instance`` caches, in tokens, where it mirrors the
        engines' cache events (an operator compares it with the engine's own count); None
        where it does not."""
        return None


class MirrorsCaches:
    """Mixed in before ``Policy`` by a policy that mirrors the engines' cache events in a
    global prefix tree (``self.tree``): forgetting an engine, resyncing it and reading
    what it caches are the tree's."""

    tree: GlobalPrefixTree

    def forget(self, instance: int) -> None:
        self.tree.forget(instance)

    def cached_tokens(self, instance: int) -> int | None:
        return self.tree.cached_tokens[instance]

    def resync(self, instance: int) -> None:
        self.forget(instance)  # the snapshot's events rebuild it


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, num_instances: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(num_instances, clock)
        self._next = 0

    def select(self, request, loads):
        choice = self._next
        while choice not in self.live:
            choice = (choice + 1) % self.num_instances
        self._next = (choice + 1) % self.num_instances
        return Decision(choice, "round_robin")


class LeastLoad(Policy):
    """Fewest requests in flight from this router; ties go round-robin so that an idle
    cluster spreads work instead of piling it on instance 0."""

    name = "least_load"

    def __init__(self, num_instances: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(num_instances, clock)
        self._start = 0

    def select(self, request, loads):
        order = [(self._start + i) % self.num_instances for i in range(self.num_instances)]
        live = [i for i in order if i in self.live]
        choice = min(live, key=lambda i: (loads[i].in_flight, loads[i].queued))
        self._start = (choice + 1) % self.num_instances
        return Decision(choice, "least_load")
