"""The router's Triton model ``preble``, in rooms from the bottom up (``tests/test_layers.py``
holds the order: a room imports only ``config`` and the rooms below it):

- ``config.py``: ``RouterConfig``; ``router_metrics.py``: the router's series.
- ``engines/``: each engine as the router reaches it: its gRPC client and stream, health
  monitor, discovery, the cursor in its event log, the loopback check.
- ``requests/``: one request's life in the router: admission (flights), the answer and
  its detokenizer, the response thread, the structured-output check, quarantine.
- ``cluster/``: the router's state over all its engines and what changes it: membership,
  migration of a request whose engine died, the admin control.
- ``router_model.py``: the Triton model that serves requests over all of it.
"""
