"""The router's response thread: the one thread that hands responses to Triton, as the
vLLM backend's response thread does.

Each ``sender.send`` and ``sender.is_cancelled`` is a round trip to the server; made on
the event loop, they would stall every other stream for it. The loop only queues (and
decides what is final: see ``flights``); this thread sends in the order queued. Before
each response that is not final it asks whether the client is still there, and if not it
drops the response and sets the flight's ``client_gone``: the loop then aborts the
request in its engine. Nothing is queued for a flight after its final response, so
``is_cancelled`` is never asked of a sender whose final response went (Triton has freed
its response factory then: a SIGSEGV in the server).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from preble_backend.router.requests.flights import Flight


class Responder:
    def __init__(
        self,
        response: Callable[[dict], object],
        error_response: Callable[[str, object], object],
        final_flag: int,
        log_error: Callable[[str], None],
    ) -> None:
        """``response(outputs)`` and ``error_response(message, code)`` make the backend's
        response objects (made here, off the loop); ``final_flag`` marks the last one."""
        self._response, self._error_response = response, error_response
        self._final_flag, self._log_error = final_flag, log_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="preble-responses", daemon=True)
        self._thread.start()

    # ---- the event loop queues ------------------------------------------------------------

    def send(self, flight: Flight, outputs: dict, final: bool) -> bool:
        """Queue a response unless the flight has ended; a final one ends it."""
        return self._put(flight, ("outputs", outputs), final)

    def fail(self, flight: Flight, message: str, code) -> bool:
        """End the flight with an error unless it has ended; True if this ended it."""
        return self._put(flight, ("error", (message, code)), final=True)

    def probe(self, flight: Flight) -> None:
        """Ask whether the client is still there (for a response that sends nothing)."""
        self._put(flight, None, final=False)

    def refuse(self, sender, message: str, code) -> None:
        """An error for a request that was never admitted."""
        self._queue.put((None, sender, ("error", (message, code)), True))

    def _put(self, flight: Flight, item, final: bool) -> bool:
        if flight.closed:
            return False
        if final:
            flight.close()
        self._queue.put((flight, flight.sender, item, final))
        return True

    def stop(self) -> None:
        """Send what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    # ---- the response thread --------------------------------------------------------------

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            flight, sender, item, final = entry
            try:
                if not final and (flight.client_gone or sender.is_cancelled()):
                    flight.client_gone = True
                    continue
                if item is None:  # a probe: the client is still there
                    continue
                kind, payload = item
                response = self._response(payload) if kind == "outputs" else self._error_response(*payload)
                sender.send(response, flags=self._final_flag if final else 0)
            except Exception as exc:  # the loop then aborts the request: no one can read it
                if flight is not None:
                    flight.client_gone = True
                self._log_error(f"preble router: a response could not be sent: {exc}")
