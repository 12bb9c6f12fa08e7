"""The one binary search behind every longest-common-prefix question in the project: the
radix cache's pages against a prompt, the global tree's chain hashes against a prompt's,
and the attention batch's shared page runs."""

from __future__ import annotations

from collections.abc import Callable


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
