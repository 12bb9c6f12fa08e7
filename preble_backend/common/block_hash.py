"""Page chain hashes: one 64-bit number per full KV page that names the whole prefix up to
the end of that page.

The global scheduler mirrors the engines' caches and matches prompts against them. Done on
token lists, every match, event and virtual eviction walks thousands of tokens in Python;
done on chain hashes, a prompt is a list of a few hundred numbers computed once, where the
request is tokenized, and the engines report their caches in the same numbers (as NVIDIA
Dynamo's KV router does with its block hashes). Because each value covers the whole
prefix, two prompts share their first ``k`` pages exactly when their ``k``-th values are
equal, so one comparison tells whether a whole radix node matches. A collision can only
misroute a request (the engine matches tokens exactly), never corrupt an answer.

The hash is polynomial over mixed tokens, so a whole prompt is hashed by a few vectorized
numpy operations: ``H(t[:n]) = Σ_{j<n} mix(t_j) · B^j  (mod 2^64)``, finalized per page.
``mix(t)`` is a bijection of ``t + 1``: no token adds nothing. Mixing ``t`` itself made
token 0 add a zero term, so a run of token 0 hashed to 0 at every length and a prompt of
them named all its own prefixes alike (the host-tier state machine found the router's
mirror losing a page to it).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)
_BASE = np.uint64(0x100000001B3)
_FINAL = np.uint64(0xBF58476D1CE4E5B9)
_ONE = np.uint64(1)
_powers = np.ones(1, dtype=np.uint64)


def _base_powers(n: int) -> np.ndarray:
    global _powers
    if len(_powers) < n:
        size = max(n, 2 * len(_powers))
        _powers = np.ones(size, dtype=np.uint64)
        np.cumprod(np.full(size - 1, _BASE, dtype=np.uint64), dtype=np.uint64, out=_powers[1:])
    return _powers[:n]


def chain_hashes(tokens: Sequence[int] | np.ndarray, page_size: int) -> array:
    """The chain hash of every full page of ``tokens`` (a partial last page has none), as
    an unsigned 64-bit ``array``: the global tree keeps slices of it per node, and an
    array slices by copying bytes, where a list of Python ints touches every object."""
    return finalized(page_sums(tokens, page_size))


def page_sums(tokens: Sequence[int] | np.ndarray, page_size: int, start: int = 0, carry: int = 0) -> array:
    """The polynomial sums ``H`` at the end of every full page of ``tokens``, before the
    per-page finalization, for tokens that continue a prefix of ``start`` tokens whose sum
    is ``carry``: a radix cache node keeps these, so a node added below another hashes
    only its own tokens (``finalized`` makes them chain hashes)."""
    pages = len(tokens) // page_size
    if pages == 0:
        return array("Q")
    n = pages * page_size
    if isinstance(tokens, list):  # the tokenizer's output: array("q") unboxes it fastest
        x = (np.frombuffer(array("q", tokens), dtype=np.uint64)[:n] + _ONE) * _MIX
    else:
        x = (np.asarray(tokens[:n], dtype=np.uint64) + _ONE) * _MIX
    x ^= x >> np.uint64(31)
    x *= _base_powers(start + n)[start:]
    h = np.cumsum(x, dtype=np.uint64)[page_size - 1 :: page_size]
    h += np.uint64(carry)
    out = array("Q")
    out.frombytes(h.tobytes())
    return out


def finalized(sums: array) -> array:
    """Chain hashes from ``page_sums``: each sum mixed so that nearby sums spread."""
    h = np.frombuffer(sums, dtype=np.uint64)
    h = h ^ (h >> np.uint64(29))
    h *= _FINAL
    h ^= h >> np.uint64(32)
    out = array("Q")
    out.frombytes(h.tobytes())
    return out
