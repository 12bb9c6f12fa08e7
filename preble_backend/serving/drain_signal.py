"""How ``preble serve`` tells a router to drain, and learns that it has.

A Python-backend model cannot take a signal (the stub's main thread waits in C++), and
tritonserver's own SIGTERM handling waits for in-flight requests, then closes every
gRPC stream without a word to its client. So before it stops the router's server,
``preble serve`` writes ``drain`` (the seconds open requests may still take) into a
directory named by ``PREBLE_DRAIN_DIR``; the router refuses new requests from then on,
ends what is still open at the deadline with "the server is shutting down", and writes
``drained`` once nothing is open.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

DRAIN_DIR_ENV = "PREBLE_DRAIN_DIR"


def request_drain(directory: Path, deadline_s: float) -> None:
    tmp = directory / "drain.tmp"
    tmp.write_text(str(deadline_s))
    tmp.replace(directory / "drain")  # whole or absent: the router never reads half a number


def wait_drained(directory: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not (directory / "drained").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def mark_drained() -> None:
    directory = os.environ.get(DRAIN_DIR_ENV)
    if directory:
        (Path(directory) / "drained").touch()


def watch_for_drain(on_drain: Callable[[float], None], stop: threading.Event, poll_s: float = 0.1) -> None:
    """Call ``on_drain(deadline_s)`` once the drain is asked for (a daemon thread; nothing
    without ``PREBLE_DRAIN_DIR``)."""
    directory = os.environ.get(DRAIN_DIR_ENV)
    if not directory:
        return
    request = Path(directory) / "drain"

    def watch() -> None:
        while not stop.wait(poll_s):
            if request.exists():
                on_drain(float(request.read_text()))
                return

    threading.Thread(target=watch, name="preble-drain-watch", daemon=True).start()
