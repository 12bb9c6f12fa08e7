"""What the front costs Triton's HTTP and gRPC APIs: the same ``/generate`` and
``/generate_stream`` requests, and the same gRPC ``ModelStreamInfer`` streams, sent
straight to tritonserver's own listeners and through the front, in alternating rounds of
one run, with emulated engines (so the engines' time is small and
the same for both). Reports latency (median, p99) and requests/s per path and concurrency,
and the front process's CPU seconds per request.

    python -m preble_backend.benchmarks.front --requests 400 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from preble_backend.runtime.front_process import start_openai_front
from preble_backend.runtime.launcher import ServerPorts, free_ports, start_server
from preble_backend.runtime.repository import write_repository


def _body(i: int, tokens: int) -> bytes:
    params = json.dumps({"max_tokens": tokens, "ignore_eos": True})
    return json.dumps({"text_input": f"request {i}, a prefix", "sampling_parameters": params}).encode()


async def _round(url: str, path: str, requests: int, concurrency: int, tokens: int) -> list[float]:
    import aiohttp

    latencies: list[float] = []
    queue = iter(range(requests))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for i in queue:
                start = time.perf_counter()
                async with session.post(f"{url}{path}", data=_body(i, tokens),
                                        headers={"content-type": "application/json"}) as resp:  # fmt: skip
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{path}: HTTP {resp.status}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def _grpc_round(url: str, _path: str, requests: int, concurrency: int, tokens: int) -> list[float]:
    """Each request one ``ModelStreamInfer`` stream, read to its final response."""
    import tritonclient.grpc.aio as grpcaio

    from client.triton_client import infer_inputs

    latencies: list[float] = []
    queue = iter(range(requests))
    client = grpcaio.InferenceServerClient(url)
    params = json.dumps({"max_tokens": tokens, "ignore_eos": True})

    async def worker() -> None:
        for i in queue:
            start = time.perf_counter()
            inputs = infer_inputs({"text_input": f"request {i}, a prefix", "stream": True,
                                   "sampling_parameters": params})  # fmt: skip

            async def one(inputs=inputs):
                yield {"model_name": "preble", "inputs": inputs,
                       "parameters": {"triton_enable_empty_final_response": True}}  # fmt: skip

            responses = client.stream_infer(one())
            async for result, error in responses:
                if error is not None:
                    raise RuntimeError(f"gRPC: {error}")
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            responses.cancel()
            latencies.append(time.perf_counter() - start)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return latencies


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def _compare(urls: dict[str, str], endpoint: str, concurrency: int, args, front_pid: int) -> None:
    """Alternate the two paths ``args.rounds`` times; print a row for each."""
    latencies: dict[str, list[float]] = {path: [] for path in urls}
    walls = dict.fromkeys(urls, 0.0)
    front_cpu = 0.0
    for _ in range(args.rounds):
        for path, url in urls.items():
            before, start = _cpu_s(front_pid), time.perf_counter()
            rounds = _grpc_round if endpoint == "grpc" else _round
            latencies[path] += asyncio.run(rounds(url, endpoint, args.requests, concurrency, args.tokens))
            walls[path] += time.perf_counter() - start
            if path == "front":
                front_cpu += _cpu_s(front_pid) - before
    for path, lat in latencies.items():
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        cost = f"{front_cpu / len(lat) * 1000:.2f}" if path == "front" else ""
        median = statistics.median(lat) * 1000
        print(f"| {endpoint.rsplit('/', 1)[-1]} | {concurrency} | {path} | {median:.1f} | {p99 * 1000:.1f} | "
              f"{len(lat) / walls[path]:.1f} | {cost} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per path, concurrency and round")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated clients at once")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of direct and front")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="preble-bench-front-"))
    repo = write_repository(work / "repo", cpu_engines=2, compute="emulated", emulated_slowdown=0.05)
    server = start_server(repo, ServerPorts(*free_ports(3)), log_path=work / "ts.log")
    front = None
    try:
        server.wait_ready()
        http_port, grpc_port = free_ports(2)
        front = start_openai_front(f"127.0.0.1:{server.ports.grpc}", 0, "tiny", work / "front.log",
                                   server=server, http_port=http_port, grpc_port=grpc_port)  # fmt: skip
        front.wait_healthy()
        urls = {
            "direct": f"http://127.0.0.1:{server.ports.http}",
            "front": f"http://127.0.0.1:{front.http_port}",
        }
        grpc_urls = {"direct": f"127.0.0.1:{server.ports.grpc}", "front": f"127.0.0.1:{grpc_port}"}
        print("| endpoint | clients | path | median ms | p99 ms | req/s | front CPU ms/req |")
        print("|---|---|---|---|---|---|---|")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for endpoint in ("/v2/models/preble/generate", "/v2/models/preble/generate_stream"):
                _compare(urls, endpoint, concurrency, args, front.process.pid)
            _compare(grpc_urls, "grpc", concurrency, args, front.process.pid)
    finally:
        if front is not None:
            front.stop()
        server.stop()


if __name__ == "__main__":
    main()
