"""Moving KV pages between engines' pools (prefill/decode disaggregation) with NIXL.

- ``layout``: where a pool's pages lie in memory, and the descriptor lists that name a set
  of pages (consecutive pages coalesced into one descriptor per layer).
- ``nixl_transport``: one engine's NIXL agents: its pool registered once, its metadata
  offered to peers, and reads of a peer's pages checked against the peer's page stamps
  (``KVPool.stamps``) so that a page freed while it was read never reaches a decode.
- ``rank_transport``: a tensor-parallel engine's side: each rank moves its own slice of
  every page with its own agents, rank 0 directing the others and checking the stamps.
"""
