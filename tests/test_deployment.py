"""The deployment files, kept true: the Kubernetes manifests validate against the
Kubernetes schemas and name the engines they run, and the containers' entrypoint runs
an engine pod and a router pod on this host (no container, no cluster here)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml
from server_utils import Pods, fresh_ports, metric_value, wait_for, wait_http_ready

from client.triton_client import PrebleClient, PrebleError
from preble_backend.router.config import RouterConfig
from preble_backend.router.engines.discovery import parse_dns_target

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "k8s" / "preble.yaml"
KUBERNETES = "1.30.0"


def documents() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFESTS.read_text()) if doc]


def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for doc in documents():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises, naming the field
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "Deployment", "Service", "Service", "StatefulSet"]


def test_the_router_finds_the_engine_pods_by_their_service_and_probes_triton():
    by_kind = {}
    for doc in documents():
        by_kind.setdefault(doc["kind"], []).append(doc)
    [config], [engines] = by_kind["ConfigMap"], by_kind["StatefulSet"]
    headless = next(s for s in by_kind["Service"] if s["spec"].get("clusterIP") == "None")
    assert engines["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["selector"] == engines["spec"]["selector"]["matchLabels"]
    assert not headless["spec"].get("publishNotReadyAddresses")  # a pod joins once Triton is ready
    router = RouterConfig.from_strings(
        {k: str(v) for k, v in json.loads(config["data"]["PREBLE_ROUTER_PARAMETERS"]).items()}
    )
    host, port, model = parse_dns_target(router.engines_dns)
    grpc = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert (host, port, model) == (headless["metadata"]["name"], grpc, "preble_engine_0")
    assert "PREBLE_ENGINES" not in config["data"]
    assert isinstance(json.loads(config["data"]["PREBLE_ENGINE_PARAMETERS"]), dict)
    for workload in (engines, *by_kind["Deployment"]):
        pod = workload["spec"]["template"]
        [container] = pod["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert engines["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.server
def test_the_entrypoint_runs_an_engine_pod_and_two_router_pods(tmp_path, tiny_model):
    """Both roles as the manifests run them (the key from the Secret, parameters from the
    ConfigMap), on loopback: each router reaches the engine by name, with the key, and
    each keeps an exact picture of the engine's cache from its event log, requests of the
    other router included. The second router names tenants by a keys file (its pod's
    PREBLE_KEYS_FILE, the Secret's API key then unused): the engine counts each tenant."""
    key = "deployment-test-key-0123456789"
    keys_file = tmp_path / "tenant-keys"
    keys_file.write_text(f"{key} team-a 2\n")
    pods = Pods(
        tmp_path,
        {
            "PREBLE_MODEL_PATH": tiny_model,
            "PREBLE_API_KEY": key,
            "PREBLE_ENGINE_KEY": "deployment-engine-key-98765",
            "PREBLE_ENGINE_PARAMETERS": json.dumps({"max_num_tokens": 8192, "page_size": 16}),
        },
    )
    eng, ports = fresh_ports(), [fresh_ports(), fresh_ports()]
    try:
        engine = pods.start("engine", "engine", eng)
        wait_http_ready(f"http://127.0.0.1:{eng.http}/v2/health/ready", 180, engine)
        routers = [
            pods.start(
                "router",
                f"router{i}",
                rtr,
                PREBLE_OPENAI_PORT="0",
                PREBLE_ENGINES=f"engine-0=grpc://127.0.0.1:{eng.grpc}/preble_engine_0",
                **({"PREBLE_KEYS_FILE": str(keys_file)} if i else {}),
            )  # fmt: skip
            for i, rtr in enumerate(ports)
        ]
        for rtr, router in zip(ports, routers):
            wait_http_ready(f"http://127.0.0.1:{rtr.http}/v2/health/ready", 180, router)
        clients = [PrebleClient(f"127.0.0.1:{p.http}", f"127.0.0.1:{p.grpc}", api_key=key) for p in ports]
        greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for i in range(6):  # alternating: each router's requests change the cache the other mirrors
            answer = clients[i % 2].generate(f"A pod per engine, request {i} " * 4, greedy)
            assert answer["instance"] == "engine-0" and answer["text_output"]
        for client in clients:  # a repeat caches nothing new: its report brings each router up to date
            client.generate("A pod per engine, request 5 " * 4, greedy)
        router_metrics = [f"http://127.0.0.1:{p.metrics}" for p in ports]

        def exact() -> bool:
            own = metric_value(f"http://127.0.0.1:{eng.metrics}", "preble_engine_kv_pages_cached")
            pictures = [metric_value(url, "preble_router_cached_pages") for url in router_metrics]
            return bool(own) and pictures == [own, own]

        # metrics are published from a thread of their own
        wait_for(exact, 15, "each router's picture of the engine's cache equal to its own count")
        engine_metrics = f"http://127.0.0.1:{eng.metrics}"

        def served(tenant: str) -> bool:
            label = f'tenant="{tenant}"'
            return bool(metric_value(engine_metrics, "preble_tenant_service_tokens_total", label))

        # the first router's requests are the default tenant's, the second's team-a's
        wait_for(lambda: served("default") and served("team-a"), 15, "the engine counting both tenants")
        with pytest.raises(Exception, match="401|Unauthorized|unauthenticated|key"):
            PrebleClient(clients[0].http_url, clients[0].grpc_url).generate("no key", greedy)
        with pytest.raises(PrebleError, match="restricted"):  # the clients' key does not open an engine
            engine_client = PrebleClient(grpc_url=f"127.0.0.1:{eng.grpc}", api_key=key)
            engine_client.engine_control("preble_engine_0", "stats")
        for process in (*routers, engine):  # Kubernetes stops a pod with SIGTERM
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
    finally:
        pods.stop()
