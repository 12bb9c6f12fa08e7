"""Fair shares on a live cluster (issue 65): two engine servers, two ``preble serve``
routers in front of both, three tenants' keys with weights 1:1:2.

Per configuration (``fair_share`` on, then off, in the same run):

- **shares**: every tenant backlogged (more clients than the engines admit), the heavy
  tenant's clients 80% on one router; each tenant's service over ``--window`` seconds, as
  the engines count it (``preble_tenant_service_tokens_total``) and as the clients count
  it (prompt + 2 x output tokens of the requests that finished in the window), against its
  weight's share;
- **light TTFT**: one light client alone, then the same client while a heavy tenant floods
  through both routers; its TTFT (p50, p99) in each. Both tenants are new to the counters.

``--cap-seconds S`` (with fair shares on only) measures instead one tenant's
``tokens_per_minute`` through both routers: its clients ask through both without pause for
S seconds, and the tokens (prompt + output) of its answered requests are counted against
what one cap allows in S seconds (a full bucket, then the refill).

Engines are emulated (``compute: emulated``: the real scheduler, cache and queues, each
pass a wait of the cost model's time), so the engines, not this host's two cores, are
what the tenants share.

    python -m preble_backend.benchmarks.tenant_shares --out tenant-shares.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from preble_backend.runtime.access import LOOPBACK, Access, new_key
from preble_backend.runtime.launcher import free_ports
from preble_backend.runtime.repository import write_repository
from preble_backend.runtime.supervisor import Supervisor, split_repository

TENANTS = {"team-a": 1.0, "team-b": 1.0, "team-c": 2.0}  # name -> weight: the shares phase's
ISOLATION = {"light": 1.0, "heavy": 1.0}  # the light-TTFT phase's, new to the counters: VTC counts
# service for good, so a tenant served beyond its share in the shares phase would wait here
CAPPED, CAP = "capped", 3000  # the cap phase's tenant and its tokens_per_minute
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()


@dataclass
class Router:
    process: subprocess.Popen
    http_port: int
    metrics_port: int

    def url(self, path: str) -> str:
        return f"http://{LOOPBACK}:{self.http_port}{path}"


@dataclass
class Cluster:
    supervisor: Supervisor
    routers: list[Router]
    engine_metrics: list[str]
    keys: dict[str, str]  # tenant -> key

    def stop(self) -> None:
        for router in self.routers:
            router.process.terminate()
        for router in self.routers:
            try:
                router.process.wait(60)
            except subprocess.TimeoutExpired:
                router.process.kill()
        self.supervisor.stop()


def start_cluster(run_dir: Path, fair_share: bool, max_running: int) -> Cluster:
    repo = write_repository(run_dir / "repo", cpu_engines=2, compute="emulated", fair_share=fair_share,
                            max_running_requests=max_running, max_num_tokens=65536)  # fmt: skip
    router_repo, engines = split_repository(repo, run_dir)
    engine_key = new_key()
    for engine in engines:
        engine.log_path = run_dir / f"{engine.model}.log"
    supervisor = Supervisor(engines, Access(host=LOOPBACK, api_key=engine_key), {})
    supervisor.start()
    weights = {**TENANTS, **ISOLATION}
    keys = {tenant: f"sk-{tenant}-{new_key()}" for tenant in weights}
    keys_file = run_dir / "keys"
    keys[CAPPED] = f"sk-{CAPPED}-{new_key()}"
    keys_file.write_text("".join(f"{keys[t]} {t} {w:g}\n" for t, w in weights.items())
                         + f"{keys[CAPPED]} {CAPPED} 1 tokens_per_minute={CAP}\n")  # fmt: skip
    routers = []
    for i in range(2):
        http, grpc, metrics = free_ports(3)
        cmd = [sys.executable, "-m", "preble_backend.cli", "serve", "--model-repository", str(router_repo),
               "--keys-file", str(keys_file), "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--openai-port", "0",
               "--log-file", str(run_dir / f"router{i}.log")]  # fmt: skip
        env = {**os.environ, "PREBLE_ENGINE_KEY": engine_key}
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        routers.append(Router(process, http, metrics))
    for router in routers:
        for line in router.process.stdout:
            if line.startswith("ready"):
                break
        else:
            raise RuntimeError(f"a router did not start: see {run_dir}")
        threading.Thread(target=router.process.stdout.read, daemon=True).start()
    metrics = [f"http://{LOOPBACK}:{e.ports.metrics}/metrics" for e in engines]
    return Cluster(supervisor, routers, metrics, keys)


def fetch(urls: list[str]) -> list[str]:
    """Each endpoint's Prometheus text, read once."""
    texts = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            texts.append(r.read().decode())
    return texts


def scrape(texts: list[str], name: str, tenant: str | None = None) -> dict[str, float]:
    """Each tenant's value of the series ``name`` (summed over ``texts`` and other labels);
    only ``tenant``'s when named, and series without a tenant under ""."""
    total: dict[str, float] = {}
    for line in (line for text in texts for line in text.splitlines()):
        if not line.startswith((name + "{", name + " ")):
            continue
        who = line.split('tenant="', 1)[1].split('"', 1)[0] if 'tenant="' in line else ""
        if tenant is None or who == tenant:
            total[who] = total.get(who, 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def engine_service(cluster: Cluster) -> dict[str, float]:
    """Each tenant's service as the engines count it, summed over engines."""
    return scrape(fetch(cluster.engine_metrics), "preble_tenant_service_tokens_total")


def layers(cluster: Cluster, tenant: str) -> dict[str, float]:
    """Running totals, to subtract: ``tenant``'s TTFT sums and counts as the routers and the
    engines measure it, and how far the emulated engines' host work ran past the modelled
    device (this host's CPU, not the schedule)."""
    routers = fetch([f"http://{LOOPBACK}:{r.metrics_port}/metrics" for r in cluster.routers])
    engines = fetch(cluster.engine_metrics)
    out = {}
    for where, texts in (("router", routers), ("engine", engines)):
        for part in ("sum", "count"):
            name = f"preble_{where}_time_to_first_token_seconds_{part}"
            out[f"{where}_{part}"] = sum(scrape(texts, name, tenant).values())
    out["behind_s"] = sum(scrape(engines, "preble_engine_emulated_behind_seconds_total").values())
    return out


@dataclass
class Clients:
    """Clients asking without pause until ``stop``: (tenant, finished at, ttft, prompt, output)."""

    done: list[tuple[str, float, float, int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def add(self, router: Router, key: str, tenant: str, prompt_words: int, max_tokens: int) -> None:
        def run() -> None:
            rng = random.Random(hash((tenant, len(self.threads), time.time())))
            while not self.stopping.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
                params = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
                body = json.dumps({"text_input": prompt, "stream": True, "sampling_parameters": params,
                                   "return_num_input_tokens": True,
                                   "return_num_output_tokens": True})  # fmt: skip
                headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
                request = urllib.request.Request(router.url("/v2/models/preble/generate_stream"),
                                                 body.encode(), headers)  # fmt: skip
                start, ttft, counts = time.monotonic(), None, {}
                try:
                    with urllib.request.urlopen(request, timeout=300) as r:
                        for line in r:
                            if not line.startswith(b"data: "):
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                raise RuntimeError(event["error"])
                            ttft = ttft if ttft is not None else time.monotonic() - start
                            counts.update({k: event[k] for k in ("num_input_tokens", "num_output_tokens")
                                           if k in event})  # fmt: skip
                except (OSError, RuntimeError, urllib.error.HTTPError) as exc:
                    self.errors.append(f"{tenant}: {exc}")
                    time.sleep(0.5)
                    continue
                prompt_tokens = int(counts.get("num_input_tokens", 0))
                output_tokens = int(counts.get("num_output_tokens", 0))
                self.done.append((tenant, time.monotonic(), ttft or 0.0, prompt_tokens, output_tokens))

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def shares_phase(cluster: Cluster, window: float, clients_per_tenant: int, skew: float) -> dict:
    clients = Clients()
    for tenant in TENANTS:
        on_first = round(clients_per_tenant * (skew if tenant == "team-c" else 0.5))
        for i in range(clients_per_tenant):
            router = cluster.routers[0 if i < on_first else 1]
            clients.add(router, cluster.keys[tenant], tenant, prompt_words=300, max_tokens=32)
    time.sleep(15)  # every tenant backlogged before the window opens
    before, opened = engine_service(cluster), time.monotonic()
    time.sleep(window)
    after, closed = engine_service(cluster), time.monotonic()
    clients.stop()
    served = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in TENANTS}
    by_clients = {t: 0.0 for t in TENANTS}
    for tenant, at, _ttft, prompt, output in clients.done:
        if opened <= at <= closed:
            by_clients[tenant] += prompt + 2 * output
    total_weight = sum(TENANTS.values())
    result = {}
    for name, counts in (("engines", served), ("clients", by_clients)):
        total = sum(counts.values())
        if not total:  # engines without fair_share count nothing
            continue
        result[name] = {t: {"share": counts[t] / total, "target": w / total_weight,
                            "error": counts[t] / total / (w / total_weight) - 1}
                        for t, w in TENANTS.items()}  # fmt: skip
    result["errors"] = len(clients.errors)
    return result


def light_ttft_phase(cluster: Cluster, seconds: float, flood_clients: int) -> dict:
    out = {}
    for flooding in (False, True):
        clients = Clients()
        if flooding:
            for i in range(flood_clients):
                clients.add(cluster.routers[i % 2], cluster.keys["heavy"], "heavy", 300, 32)
            time.sleep(10)
        light, before = Clients(), layers(cluster, "light")
        light.add(cluster.routers[0], cluster.keys["light"], "light", 300, 32)
        time.sleep(seconds)
        light.stop()
        after = layers(cluster, "light")
        clients.stop()
        ttfts = [ttft for _tenant, _at, ttft, _prompt, _output in light.done]
        d = {k: after[k] - before[k] for k in after}
        out["flood" if flooding else "alone"] = {
            "requests": len(ttfts), "p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99),
            "mean": sum(ttfts) / max(len(ttfts), 1),
            "router_mean": d["router_sum"] / max(d["router_count"], 1),
            "engine_mean": d["engine_sum"] / max(d["engine_count"], 1),
            "emulated_behind_s": d["behind_s"],
        }  # fmt: skip
    out["p50_ratio"] = out["flood"]["p50"] / out["alone"]["p50"]
    out["p99_ratio"] = out["flood"]["p99"] / out["alone"]["p99"]
    return out


def cap_phase(cluster: Cluster, seconds: float, clients_per_router: int) -> dict:
    """The capped tenant's clients on both routers for ``seconds``: its tokens answered, as
    the clients count them, against one cap's allowance over that time."""
    clients = Clients()
    for i in range(2 * clients_per_router):
        clients.add(cluster.routers[i % 2], cluster.keys[CAPPED], CAPPED, prompt_words=100, max_tokens=16)
    time.sleep(seconds)
    clients.stop()
    tokens = sum(prompt + output for *_, prompt, output in clients.done)
    allowed = CAP * (1 + seconds / 60.0)
    refused = sum("429" in error for error in clients.errors)
    return {"seconds": seconds, "cap_per_minute": CAP, "answered": len(clients.done), "tokens": tokens,
            "allowed_one_cap": allowed, "ratio": tokens / allowed, "refused_429": refused,
            "other_errors": len(clients.errors) - refused}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=60.0, help="seconds the shares are measured over")
    p.add_argument("--clients", type=int, default=12, help="clients per tenant in the shares phase")
    p.add_argument("--skew", type=float, default=0.8, help="the heavy tenant's fraction on the first router")
    p.add_argument("--max-running", type=int, default=8, help="each engine's max_running_requests")
    p.add_argument("--light-seconds", type=float, default=30.0)
    p.add_argument("--cap-seconds", type=float, default=0.0, help="measure the cap phase only, this long")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    results = {}
    if args.cap_seconds:
        with tempfile.TemporaryDirectory(prefix="preble-tenants-") as tmp:
            cluster = start_cluster(Path(tmp), True, args.max_running)
            try:
                results["cap"] = cap = cap_phase(cluster, args.cap_seconds, 2)
            finally:
                cluster.stop()
        print(f"cap: {cap['tokens']} tokens answered in {cap['seconds']:g} s through two routers, one cap "
              f"allows {cap['allowed_one_cap']:.0f} (x{cap['ratio']:.2f}); {cap['answered']} answered, "
              f"{cap['refused_429']} refused 429, {cap['other_errors']} other errors")  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return 0
    for fair_share in (True, False):
        with tempfile.TemporaryDirectory(prefix="preble-tenants-") as tmp:
            cluster = start_cluster(Path(tmp), fair_share, args.max_running)
            try:
                shares = shares_phase(cluster, args.window, args.clients, args.skew)
                light = light_ttft_phase(cluster, args.light_seconds, 3 * args.clients)
            finally:
                cluster.stop()
        name = "fair_share" if fair_share else "fcfs"
        results[name] = {"shares": shares, "light_ttft": light}
        for source in (s for s in ("engines", "clients") if s in shares):
            line = ", ".join(f"{t} {v['share']:.3f}/{v['target']:.3f} ({v['error']:+.1%})"
                             for t, v in shares[source].items())  # fmt: skip
            print(f"{name}: shares ({source}) {line}")
        for phase in ("alone", "flood"):
            row = light[phase]
            print(f"{name}: light TTFT {phase}, mean: client {row['mean']:.3f}s, "
                  f"router {row['router_mean']:.3f}s, engine {row['engine_mean']:.3f}s; "
                  f"emulated engines behind {row['emulated_behind_s']:.2f}s")  # fmt: skip
        print(f"{name}: light TTFT alone p50 {light['alone']['p50']:.3f}s p99 {light['alone']['p99']:.3f}s; "
              f"with a flood p50 {light['flood']['p50']:.3f}s p99 {light['flood']['p99']:.3f}s "
              f"(x{light['p50_ratio']:.2f}, x{light['p99_ratio']:.2f}); client errors {shares['errors']}",
              flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
