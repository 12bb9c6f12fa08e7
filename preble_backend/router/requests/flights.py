"""The router's admitted requests ("flights") and its bounded admission.

At most ``max_inflight`` requests are forwarded to engines at once and ``max_queue`` more
wait for a slot; a request beyond that is refused at once (Triton ``UNAVAILABLE``), so a
burst never grows queues or memory without bound.

A flight lives on the router's event loop: every change to it is made there, so none
needs a lock. The one exception is ``client_gone``, which the response thread sets when
it finds the client cancelled (a plain store; the loop reads it at the next engine
response). A request can be ended from two places — its own task, and the engine monitor
when its engine dies — and the first final response wins: a flight is ``closed`` when
its final response is queued, and nothing is queued for it after. Closing gives its slot
back at once.

Waiting for a slot is fair between tenants: a freed slot goes to the first waiter of the
tenant that comes first in ``order`` (the cluster's service per unit of weight,
``router/cluster/tenant_shares.py``), FIFO within a tenant; with one tenant, arrival order.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from preble_backend.common.fair_share import DEFAULT_TENANT, TenantShares


class Flight:
    def __init__(self, flights: Flights, number: int, sender, tenant: str = DEFAULT_TENANT) -> None:
        self.flights, self.number, self.sender, self.tenant = flights, number, sender, tenant
        self.instance: int | None = None  # the engine it was sent to, once routed
        self.routing = None  # the policy's RoutingRequest, once routed
        self.prefill: int | None = None  # the engine that prefills it first, when disaggregated
        self.engine_finished = False  # the engine's final response arrived
        self.settled = False  # the router's load and policy bookkeeping is done
        self.closed = False  # its final response is queued
        self.client_gone = False  # set by the response thread
        self._has_slot = False

    async def wait_for_slot(self) -> bool:
        """Wait until a forwarding slot is this flight's; False if the flight ended meanwhile."""
        flights = self.flights
        if flights._free and not flights._waiting:
            flights._free -= 1
        else:
            turn = asyncio.get_running_loop().create_future()
            flights._wait(self.tenant, turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # the slot came as it was cancelled
                    flights._hand_on()
                else:
                    flights._drop(self.tenant, turn)
                raise
        if self.closed:
            flights._hand_on()
            return False
        self._has_slot = True
        flights._forwarding += 1
        return True

    def close(self) -> bool:
        """End the flight (its final response is on its way); False if it had ended."""
        if self.closed:
            return False
        self.closed = True
        self.flights._release(self)
        return True


class Flights:
    def __init__(self, max_inflight: int, max_queue: int, shares: TenantShares | None = None) -> None:
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self.shares = shares  # None: one queue, arrival order
        self._free = max_inflight
        self._waiting: dict[str, deque[asyncio.Future]] = {}  # tenant -> its flights' turns, FIFO
        self._open: dict[int, Flight] = {}
        self._forwarding = 0
        self._numbers = itertools.count()

    def admit(self, sender, tenant: str = DEFAULT_TENANT) -> Flight | None:
        """A new flight, or None when ``max_inflight + max_queue`` are already admitted."""
        if len(self._open) >= self.max_inflight + self.max_queue:
            return None
        flight = Flight(self, next(self._numbers), sender, tenant)
        self._open[flight.number] = flight
        return flight

    def capacity_message(self) -> str:
        return (f"the preble router is at capacity: {self.max_inflight} requests in flight and "
                f"{self.max_queue} queued (max_inflight, max_queue in its config.pbtxt); "
                "retry later")  # fmt: skip

    def on_instance(self, instance: int) -> list[Flight]:
        return [f for f in self._open.values() if f.instance == instance]

    def all(self) -> list[Flight]:
        return list(self._open.values())

    def counts(self) -> tuple[int, int]:
        """(admitted, of which waiting for a slot)."""
        return len(self._open), len(self._open) - self._forwarding

    def _release(self, flight: Flight) -> None:
        self._open.pop(flight.number, None)
        if flight._has_slot:
            flight._has_slot = False
            self._forwarding -= 1
            self._hand_on()

    def _wait(self, tenant: str, turn: asyncio.Future) -> None:
        key = tenant if self.shares is not None else ""
        if key not in self._waiting and self.shares is not None:  # it becomes backlogged: VTC's lift
            self.shares.lift(tenant, list(self._waiting))
        self._waiting.setdefault(key, deque()).append(turn)

    def _drop(self, tenant: str, turn: asyncio.Future) -> None:
        key = tenant if self.shares is not None else ""
        turns = self._waiting.get(key)
        if turns is not None and turn in turns:
            turns.remove(turn)
            if not turns:
                del self._waiting[key]

    def _hand_on(self) -> None:
        """A slot is free: the next turn of the least served tenant, else back to the pool."""
        if self._waiting:
            tenant = self.shares.order(self._waiting)[0] if self.shares is not None else ""
            turns = self._waiting[tenant]
            turns.popleft().set_result(None)
            if not turns:
                del self._waiting[tenant]
            return
        self._free += 1
