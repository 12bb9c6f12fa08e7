"""What the router measures: its Prometheus series (as vLLM names its request metrics;
per request, labelled by policy and engine) and the failure reasons it counts."""

from __future__ import annotations

from preble_backend.serving.metrics import MetricSpec

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
FAILURES = {  # Triton error code's name -> the failures counter's reason
    "INVALID_ARG": "invalid",
    "UNAVAILABLE": "unavailable",
    "CANCELLED": "cancelled",
    "INTERNAL": "internal",
}
METRICS = [  # as vLLM names its request metrics; per request, labelled by policy and engine
    MetricSpec("preble_router_decisions_total", "counter", "routing decisions"),
    MetricSpec("preble_router_rejected_total", "counter", "requests refused: the router was at capacity"),
    MetricSpec("preble_router_failures_total", "counter", "requests that ended with an error, by reason"),
    MetricSpec("preble_router_e2e_request_latency_seconds", "histogram", "arrival to final response",
               LATENCY_BUCKETS),
    MetricSpec("preble_router_time_to_first_token_seconds", "histogram", "arrival to first token",
               LATENCY_BUCKETS),
    MetricSpec("preble_router_time_per_output_token_seconds", "histogram",
               "first to last token over the tokens after the first", TOKEN_LATENCY_BUCKETS),
    MetricSpec("preble_router_queue_time_seconds", "histogram",
               "arrival to forwarded (waiting for a forwarding slot, tokenizing, routing)", LATENCY_BUCKETS),
    MetricSpec("preble_router_request_prompt_tokens", "histogram", "prompt tokens per request",
               TOKEN_BUCKETS),
    MetricSpec("preble_router_request_generation_tokens", "histogram", "generated tokens per request",
               TOKEN_BUCKETS),
    MetricSpec("preble_router_prompt_tokens_total", "counter", "prompt tokens of finished requests"),
    MetricSpec("preble_router_cached_prompt_tokens_total", "counter",
               "prompt tokens the engines' prefix caches served"),
    MetricSpec("preble_router_engine_up", "gauge",
               "1 while the engine takes requests, 0 once it failed, left, or before it first answers"),
    MetricSpec("preble_router_engines", "gauge", "engines discovery names now"),
    MetricSpec("preble_router_cached_pages", "gauge",
               "KV pages the policy believes the engine caches (from its cache events; E2 and kv_cost)"),
    MetricSpec("preble_router_gpu_utilization", "gauge",
               "the engine's GPU busy fraction, as the router last sampled it (NVML; engines on this host)"),
    MetricSpec("preble_router_gpu_memory_fraction", "gauge",
               "the engine's GPU memory in use, as the router last sampled it (NVML; engines on this host)"),
    MetricSpec("preble_router_migrations_total", "counter",
               "requests that went on elsewhere when their engine failed, by the engine that failed"),
    MetricSpec("preble_router_cost_model_learnt", "gauge",
               "1 while E2 prices the engine with its online fit, 0 with a prior or a fixed fit"),
    MetricSpec("preble_router_cost_model_mismatch", "gauge",
               "1 while E2 prices the engine with another model's or device's fit (a fixed one, or a prior "
               "until the online fit takes over), or before the engine said what it serves"),
    MetricSpec("preble_router_cost_fit_error", "gauge",
               "the fit in use: RMS relative error over the engine's recent passes"),
    MetricSpec("preble_router_cost_fit_passes", "gauge", "the engine's recent passes the fit weighs"),
    MetricSpec("preble_router_cost_ms", "gauge",
               "the fit in use, by term: base, prefill per token, decode per request, attention per "
               "context token, decode step"),
    MetricSpec("preble_router_tenant_in_flight", "gauge",
               "each tenant's requests this router has admitted and not yet answered"),
    MetricSpec("preble_tenant_fairness_index", "gauge",
               "Jain's index over the service per unit of weight the backlogged tenants received in the "
               "last minute, as this router's copy of the cluster's counts says (1: shares as weighted)"),
    MetricSpec("preble_router_prefill_legs_total", "counter",
               "disaggregated requests' prefills on a prefill engine, by outcome: offered (its KV went to "
               "the decode engine), failed or no_offer (the request prefilled on its decode engine)"),
    MetricSpec("preble_router_prefill_leg_seconds", "histogram", "a prefill leg, sent to its offer",
               LATENCY_BUCKETS),
    MetricSpec("preble_router_poisoned_total", "counter",
               "requests failed because every engine that ran them failed (then refused for poison_ttl_s)"),
]  # fmt: skip
