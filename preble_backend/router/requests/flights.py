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
"""

from __future__ import annotations

import asyncio
import itertools


class Flight:
    def __init__(self, flights: Flights, number: int, sender) -> None:
        self.flights, self.number, self.sender = flights, number, sender
        self.instance: int | None = None  # the engine it was sent to, once routed
        self.routing = None  # the policy's RoutingRequest, once routed
        self.prefill: int | None = None  # the engine that prefills it first, when disaggregated
        self.engine_finished = False  # the engine's final response arrived
        self.settled = False  # the router's load and policy bookkeeping is done
        self.closed = False  # its final response is queued
        self.client_gone = False  # set by the response thread
        self._has_slot = False

    async def wait_for_slot(self) -> bool:
        """Wait until a forwarding slot is free; False if the flight ended meanwhile."""
        await self.flights._slots.acquire()
        if self.closed:
            self.flights._slots.release()
            return False
        self._has_slot = True
        self.flights._forwarding += 1
        return True

    def close(self) -> bool:
        """End the flight (its final response is on its way); False if it had ended."""
        if self.closed:
            return False
        self.closed = True
        self.flights._release(self)
        return True


class Flights:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self._slots = asyncio.Semaphore(max_inflight)  # bound to the loop at its first wait
        self._open: dict[int, Flight] = {}
        self._forwarding = 0
        self._numbers = itertools.count()

    def admit(self, sender) -> Flight | None:
        """A new flight, or None when ``max_inflight + max_queue`` are already admitted."""
        if len(self._open) >= self.max_inflight + self.max_queue:
            return None
        flight = Flight(self, next(self._numbers), sender)
        self._open[flight.number] = flight
        return flight

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
            self._slots.release()
