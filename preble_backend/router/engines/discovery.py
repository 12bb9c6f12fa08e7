"""Which engines a router forwards to, from sources that may change while it serves.

Three sources, joined: the static ``engines`` list; a DNS name with one address per engine
server (``engines_dns``: a Kubernetes headless Service names every ready pod of a
StatefulSet so); and a file of entries in ``engines`` syntax (``engines_file``: a mounted
ConfigMap, which Kubernetes updates in place). A poller thread reads the changing sources
every ``interval_s`` and reports the entries that appeared and those that went; the router
probes, adds, drains and removes the engines. Entries are keyed by their whole spec, so a
name that comes back at another address is a new engine.

A resolver failure keeps the last answer (one lost DNS reply must not empty the router);
only a name with no addresses at all (NXDOMAIN, no records) counts as "no engines".
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

from preble_backend.router.engines.engine_client import parse_engine_entry

NO_ADDRESSES = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}


def split_entries(text: str) -> list[str]:
    """Entries separated by commas or lines; ``#`` starts a comment."""
    lines = (line.partition("#")[0] for line in text.splitlines())
    return [e.strip() for line in lines for e in line.split(",") if e.strip()]


def parse_dns_target(target: str) -> tuple[str, int, str]:
    """``host:port/model`` -> (host, port, model)."""
    address, _, model = target.partition("/")
    host, _, port = address.rpartition(":")
    if not host or not model or not port.isdigit():
        raise ValueError(f"engines_dns={target!r} is invalid: expected host:port/model")
    return host, int(port), model


def dns_entries(target: str, resolve: Callable = socket.getaddrinfo) -> list[str]:
    """One ``ip:port=grpc://ip:port/model`` entry per address the name resolves to now."""
    host, port, model = parse_dns_target(target)
    addresses = sorted({info[4][0] for info in resolve(host, port, type=socket.SOCK_STREAM)})
    entries = []
    for ip in addresses:
        where = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        entries.append(f"{where}=grpc://{where}/{model}")
    return entries


class Discovery:
    def __init__(
        self,
        static: str,
        dns: str = "",
        file: str = "",
        interval_s: float = 5.0,
        warn: Callable[[str], None] = print,
        resolve: Callable = socket.getaddrinfo,
    ) -> None:
        self.static = split_entries(static)
        for entry in self.static:
            parse_engine_entry(entry)  # a bad entry is refused at load
        if dns:
            parse_dns_target(dns)
        self.dns, self.file, self.interval_s = dns, Path(file) if file else None, interval_s
        self._warn, self._resolve = warn, resolve
        self._last: dict[str, list[str]] = {"dns": [], "file": []}
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.current: list[str] = self.read()

    @property
    def dynamic(self) -> bool:
        return bool(self.dns or self.file)

    def read(self) -> list[str]:
        """Every entry the sources name now, in order, each once; a source that cannot be
        read gives its last answer."""
        if self.dns:
            self._last["dns"] = self._read("dns", lambda: dns_entries(self.dns, self._resolve))
        if self.file is not None:
            self._last["file"] = self._read("file", lambda: split_entries(self.file.read_text()))
        return list(dict.fromkeys([*self.static, *self._last["dns"], *self._last["file"]]))

    def _read(self, source: str, read: Callable[[], list[str]]) -> list[str]:
        try:
            entries = read()
            for entry in entries:
                parse_engine_entry(entry)
        except socket.gaierror as exc:
            if exc.errno in NO_ADDRESSES:
                return []
            return self._keep(source, f"engines_dns={self.dns!r} did not resolve ({exc})")
        except FileNotFoundError:
            return []  # a ConfigMap key not written yet: no engines from it
        except (OSError, ValueError) as exc:
            return self._keep(source, f"engines_{source} could not be read ({exc})")
        self._warned.discard(source)
        return entries

    def _keep(self, source: str, problem: str) -> list[str]:
        if source not in self._warned:
            self._warned.add(source)
            self._warn(f"preble router: {problem}; keeping its last {len(self._last[source])} engine(s)")
        return self._last[source]

    def start(self, on_change: Callable[[list[str], list[str]], None]) -> None:
        """Poll the changing sources; ``on_change(joined, left)`` from the poller thread."""
        if not self.dynamic or self._thread is not None:
            return

        def poll() -> None:
            while not self._stop.wait(self.interval_s):
                now = self.read()
                joined = [e for e in now if e not in self.current]
                left = [e for e in self.current if e not in now]
                self.current = now
                if joined or left:
                    on_change(joined, left)

        self._thread = threading.Thread(target=poll, name="preble-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
