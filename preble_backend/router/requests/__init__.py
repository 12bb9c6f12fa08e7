"""One request's life in the router: admission (``flights``), its answer and incremental
detokenizer (``answer``, ``detokenizer``), the response thread (``responder``), the
structured-output check before routing (``guide_check``), and quarantine for requests
that took engines down (``quarantine``). Imports ``engines`` for an engine's response."""
