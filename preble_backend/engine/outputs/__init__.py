"""Logits into tokens: sampling and log-probabilities (``sampling``), grammar-constrained
decoding (``guided``) and the process that checks a grammar before a request is admitted
(``guided_worker``). Imports no other part of the engine: a request's state is handed in."""
