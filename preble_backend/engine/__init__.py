"""The paged-KV engine, in rooms from the bottom up (``tests/test_layers.py`` holds the
order: a room imports only ``config`` and the rooms below it):

- ``config.py``: ``EngineConfig``, every tunable; imports no room.
- ``cache/``: what is cached where: the radix tree and its nodes, the host tier and the
  moves between tiers, the changes a step makes and the event log routers read.
- ``outputs/``: logits into tokens: sampling, and structured outputs (grammar masks).
- ``scheduling/``: a request's life in the engine: the request, the paper's priority wait
  queue, the pages it holds (block manager), the local scheduler's batches, when it stops.
- ``runners/``: a batch through the model: the model runner, the emulated runner (the
  simulator's costs), a tensor-parallel engine's other ranks.
- ``engine.py``: the loop over all of them, and the engine's public API.
"""
