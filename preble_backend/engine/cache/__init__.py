"""What the engine has cached, and where: the radix tree (``radix_cache``, ``radix_node``),
the host tier and the moves between GPU and host pages (``host_tier``, ``tier_moves``),
a step's changes coalesced (``cache_changes``) and the numbered event log every router
mirrors (``event_log``). The bottom room: it imports no other part of the engine."""
