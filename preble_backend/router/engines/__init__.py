"""Each engine as the router reaches it: a gRPC stream (``engine_stream``) under a client
(``engine_client``), health probes (``engine_monitor``), the engines discovery names
(``discovery``), this router's cursor in an engine's event log (``event_feed``) and the
check that a local engine is this server's own (``loopback``). The bottom room."""
