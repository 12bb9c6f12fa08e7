"""Progress of long work, watched or not: tqdm's bar where stderr is a terminal; elsewhere
(a log file, CI, a pipe), where a bar draws nothing, a line that says up front how much
work there is, then a line as units finish (at most one per ``interval_s``) and one at the
end, so that a run nobody watches still says it is alive."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator


class Lines:
    """The part of tqdm's API the long commands use, written as lines."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", interval_s: float = 5.0, **_ignored) -> None:  # fmt: skip
        self.iterable, self.desc, self.unit, self.interval_s = iterable, desc, unit, interval_s
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self.postfix, self.began = 0, "", time.monotonic()
        self.said_at, self.said_n = self.began, -1
        size = f"{self.total} {unit}s" if self.total is not None else f"{unit}s"
        self._say(f"{size} to do")

    def _say(self, what: str) -> None:
        print(f"{self.desc}: {what}" if self.desc else what, file=sys.stderr, flush=True)

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        extra = f"; {self.postfix}" if self.postfix else ""
        self._say(f"{self.n}{of} {self.unit}s done after {time.monotonic() - self.began:.0f} s{extra}")
        self.said_at, self.said_n = time.monotonic(), self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.said_at >= self.interval_s or self.n == self.total:
            self._line()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        if self.said_n != self.n:
            self._line()

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(iterable: Iterable | None = None, **kwargs):
    """A tqdm bar on a terminal, ``Lines`` elsewhere (``total``, ``desc``, ``unit`` as tqdm)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, **kwargs)
    return Lines(iterable, **kwargs)
