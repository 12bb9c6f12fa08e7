"""The router's engines as discovery changes them (``engines/discovery.py``), on the event loop.

Every per-engine table of the router is indexed by slot. An engine that joins gets a new
slot in each (and in the policy) and takes requests once a health probe answers; one
that leaves takes no new requests, has ``leave_timeout_s`` to finish its own (those left
then move on, as a failed engine's do), and is forgotten. A slot is never given to
another engine, so a departed engine's request still settling cannot touch a newcomer's
counts; an entry that comes back gets its old slot again.
"""

from __future__ import annotations

import asyncio
import time

import triton_python_backend_utils as pb_utils

from preble_backend.router.cluster.router_state import RouterState
from preble_backend.router.engines.engine_client import make_engine_client
from preble_backend.router.engines.event_feed import EventFeed
from scheduler.policy import InstanceLoad


class Membership:
    def __init__(self, router: RouterState, entries: list[str]) -> None:
        self.router = router
        self.slots = {entry: i for i, entry in enumerate(entries)}  # discovery entry -> slot
        self.members = set(self.slots.values())  # slots discovery names now
        self.leaving: dict[int, asyncio.Task] = {}  # slot -> its drain, while its requests finish
        self.joining: set[int] = set()  # slots that joined and have not answered a probe yet

    def change(self, joined: list[str], left: list[str]) -> None:
        for entry in left:
            self._leave(entry)
        for entry in joined:
            try:
                self._join(entry)
            except Exception as exc:  # one bad entry must not stop the others
                pb_utils.Logger.log_error(f"preble router: engine {entry!r} cannot join: {exc}")
        self.router.metrics.gauge("preble_router_engines", len(self.members))

    def first_answer(self, slot: int) -> bool:
        """The engine is up: is this its first answer since it joined?"""
        first = slot in self.joining
        self.joining.discard(slot)
        return first

    def _join(self, entry: str) -> None:
        """A new engine gets a slot everywhere; one that left gets its slot back (its drain
        called off if it is still draining). It takes requests once a probe answers."""
        r = self.router
        slot = self.slots.get(entry)
        if slot is None:
            slot = self.slots[entry] = len(r.engines)
            r.engines.append(make_engine_client(entry, r.server_url))
            r.loads.append(InstanceLoad())
            r.feeds.append(EventFeed())
            r.load_view.add(slot)
            r.policy.add_instance()  # the policy's slots are the router's: the same next index
        elif (drain := self.leaving.pop(slot, None)) is not None:
            drain.cancel()  # it still holds its cache, as the policy still believes
        elif slot not in self.members:  # it left and was forgotten
            r.engines[slot] = make_engine_client(entry, r.server_url)
            r.loads[slot], r.feeds[slot] = InstanceLoad(), EventFeed()
            r.load_view.add(slot)
        self.members.add(slot)
        self.joining.add(slot)
        r.metrics.gauge("preble_router_engine_up", 0, {"engine": r.engines[slot].name})
        r.monitor.watch(slot, r.engines[slot])
        pb_utils.Logger.log_info(f"preble router: engine {r.engines[slot].name} joined; probing it")

    def _leave(self, entry: str) -> None:
        r, slot = self.router, self.slots[entry]
        if slot not in self.members:
            return
        name = r.engines[slot].name
        self.members.discard(slot)
        r.monitor.unwatch(slot)
        r.policy.withdraw(slot)
        r.metrics.gauge("preble_router_engine_up", 0, {"engine": name})
        pb_utils.Logger.log_info(f"preble router: engine {name} left; draining its "
                                 f"{len(r.flights.on_instance(slot))} requests")  # fmt: skip
        self.leaving[slot] = r.loop.create_task(self._drain(slot))

    async def _drain(self, slot: int) -> None:
        """Its requests finish there until ``leave_timeout_s``; those left then move on
        (their streams are cancelled, so they migrate). Then the engine is forgotten."""
        r = self.router
        engine, deadline = r.engines[slot], time.monotonic() + r.config.leave_timeout_s
        while r.flights.on_instance(slot) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if r.flights.on_instance(slot):
            engine.cancel_all()
            while r.flights.on_instance(slot) and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.05)
        del self.leaving[slot]  # from here on a return makes a fresh client: nothing awaits first
        r.policy.instance_down(slot)  # its cache is forgotten: the tree holds nothing of it
        r.gauge_cached(slot)
        engine.close()
        await engine.aclose()
        pb_utils.Logger.log_info(f"preble router: engine {engine.name} removed")
