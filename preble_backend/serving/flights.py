"""The router's admitted requests ("flights") and its bounded admission.

At most ``max_inflight`` requests are forwarded to engines at once and ``max_queue`` more
wait for a slot; a request beyond that is refused at once (Triton ``UNAVAILABLE``), so a
burst never grows queues or memory without bound.

A flight is the only writer of its client's response sender. A request can be ended from
two places — the worker thread forwarding it, and the engine monitor when its engine dies
(the monitor then cancels the worker's stream to that engine) — and the first final
response wins; later ones are dropped. Closing a flight gives its slot back at once.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable


class Flight:
    def __init__(self, flights: Flights, number: int, sender) -> None:
        self.flights, self.number, self.sender = flights, number, sender
        self.instance: int | None = None  # the engine it was sent to, once routed
        self.routing = None  # the policy's RoutingRequest, once routed
        self.engine_finished = False  # the engine's final response arrived
        self.settled = False  # the router's load and policy bookkeeping is done
        self._lock = threading.Lock()
        self._closed = False
        self._has_slot = False

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_for_slot(self) -> bool:
        """Block until a forwarding slot is free; False if the flight ended meanwhile."""
        self.flights._slots.acquire()
        with self._lock:
            if self._closed:
                self.flights._slots.release()
                return False
            self._has_slot = True
            with self.flights._lock:
                self.flights._forwarding += 1
            return True

    def is_cancelled(self) -> bool:
        """The client cancelled or went away; an ended flight counts as cancelled. Asked
        under the lock: ``is_cancelled`` on a sender whose final response was sent reads
        a response factory Triton has freed (a SIGSEGV in the server, seen under load)."""
        with self._lock:
            return self._closed or self.sender.is_cancelled()

    def send(self, response, final: bool, final_flag: int) -> bool:
        """Send unless already ended; a final response ends the flight."""
        with self._lock:
            if self._closed:
                return False
            try:
                self.sender.send(response, flags=final_flag if final else 0)
            finally:
                if final:
                    self._close()
            return True

    def end(self, send_final: Callable[[], None]) -> bool:
        """End the flight with ``send_final`` (an error response) unless it already ended."""
        with self._lock:
            if self._closed:
                return False
            try:
                send_final()
            finally:
                self._close()
            return True

    def _close(self) -> None:
        self._closed = True
        self.flights._release(self, self._has_slot)
        self._has_slot = False


class Flights:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self._slots = threading.Semaphore(max_inflight)
        self._lock = threading.Lock()
        self._open: dict[int, Flight] = {}
        self._forwarding = 0
        self._numbers = itertools.count()

    def admit(self, sender) -> Flight | None:
        """A new flight, or None when ``max_inflight + max_queue`` are already admitted."""
        with self._lock:
            if len(self._open) >= self.max_inflight + self.max_queue:
                return None
            flight = Flight(self, next(self._numbers), sender)
            self._open[flight.number] = flight
            return flight

    def on_instance(self, instance: int) -> list[Flight]:
        with self._lock:
            return [f for f in self._open.values() if f.instance == instance]

    def all(self) -> list[Flight]:
        with self._lock:
            return list(self._open.values())

    def counts(self) -> tuple[int, int]:
        """(admitted, of which waiting for a slot)."""
        with self._lock:
            return len(self._open), len(self._open) - self._forwarding

    def _release(self, flight: Flight, had_slot: bool) -> None:
        with self._lock:
            self._open.pop(flight.number, None)
            if had_slot:
                self._forwarding -= 1
        if had_slot:
            self._slots.release()
