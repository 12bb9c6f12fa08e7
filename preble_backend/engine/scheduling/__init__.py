"""A request's life in the engine: the request itself (``request``), the paper's priority
wait queue (``priority_queue``), the pages it holds (``block_manager``), the batches the
local scheduler forms with chunked prefill (``local_scheduler``) and when it stops
(``stop_checker``). Imports ``engine.config``, ``cache`` and ``outputs``."""
