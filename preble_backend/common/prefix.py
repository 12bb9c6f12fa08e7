"""The one binary search behind every longest-common-prefix question in the project: the
radix cache's pages against a prompt, the global tree's chain hashes against a prompt's,
and the attention batch's shared page runs; and, for models with sliding-window layers,
how much of such a prefix a request can start after (the engine's and the global tree's
one rule)."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def longest_match(limit: int, matches: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``[0, limit]`` with ``matches(n)``, for a test that holds up to
    some length and fails beyond it (two sequences' first ``n`` items agree). The whole
    run is tried first: it is the usual answer."""
    if matches(limit):
        return limit
    lo, hi = 0, limit - 1  # matches(lo) holds (n = 0 always does); matches(limit) fails
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if matches(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def first_window_page(computed: int, window: int, page_size: int) -> int:
    """The first page a sliding layer still reads after ``computed`` tokens: the next
    query, at ``computed``, sees keys from ``computed - window + 1`` on."""
    return max(0, computed - window + 1) // page_size


def window_hit(held: Iterable[bool], window: int, page_size: int) -> int:
    """How many leading pages of a cached prefix a request can start after, given which
    pages still hold their sliding layers' KV: the most whose last window is all held
    (right to left, as vLLM's sliding-window manager matches; 0 always qualifies)."""
    best = run = 0
    for k, page_held in enumerate(held, start=1):
        run = run + 1 if page_held else 0  # held pages ending at page k - 1
        if k - first_window_page(k * page_size, window, page_size) <= run:
            best = k
    return best
