"""A prefill-side peer for the KV transfer tests: a process holding a seeded pool behind a
``KVTransport``, driven over a pipe (the tests' stand-in for the engines' channel)."""

from __future__ import annotations

import torch

from preble_backend.model.kv_pool import KVPool

SHAPE = dict(num_pages=64, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def seeded_pool(seed: int, **overrides) -> KVPool:
    pool = KVPool(**{**SHAPE, **overrides})
    g = torch.Generator().manual_seed(seed)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    return pool


def serve(conn, seed: int) -> None:
    """Offer the pool, then free pages on request (``("free", pages)``) and answer with
    the stamps, until ``"stop"``."""
    from preble_backend.kv_transfer.nixl_transport import KVTransport

    pool = seeded_pool(seed)
    transport = KVTransport("prefill", pool)
    conn.send(transport.offer())
    while (message := conn.recv()) != "stop":
        _, pages = message
        pool.free(pages)
        conn.send(pool.stamps.tolist())
    transport.close()
