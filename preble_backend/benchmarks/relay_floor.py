"""The floor under the router's data path: what a decoupled Python-backend model that does
nothing but relay costs per request, and what opening one gRPC stream per request costs
its client (the router opens one to an engine per request).

A model ``echo`` reads a prompt-sized ``text_input`` and answers with ``--chunks`` streamed
responses and a final flag (the router's coalesced answer to a ToolBench request); the
client sends ``--requests`` at each rate, one ``ModelStreamInfer`` stream each. Printed
per request: tritonserver + stub CPU, and this client's CPU.

    python -m preble_backend.benchmarks.relay_floor --rates 10,40 --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from client.triton_client import infer_inputs
from preble_backend.common.procfs import cpu_seconds, process_tree
from preble_backend.runtime.launcher import ServerPorts, free_ports, start_server

CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "chunks" value: { string_value: "%d" } }
"""
MODEL = """import json
import numpy as np
import triton_python_backend_utils as pb_utils

CHUNK = np.array([b"a coalesced chunk of text"], dtype=np.object_)


class TritonPythonModel:
    def initialize(self, args):
        self.chunks = int(json.loads(args["model_config"])["parameters"]["chunks"]["string_value"])

    def execute(self, requests):
        for request in requests:
            pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            sender = request.get_response_sender()
            for _ in range(self.chunks):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", CHUNK)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


async def _run(grpc_url: str, server_pids: list[int], rate: float, requests: int, prompt: str) -> str:
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(grpc_url)

    async def one() -> None:
        async def request():
            yield {"model_name": "echo", "inputs": infer_inputs({"text_input": prompt}),
                   "parameters": {"triton_enable_empty_final_response": True}}  # fmt: skip

        async for result, error in client.stream_infer(request()):
            if error is not None:
                raise RuntimeError(str(error))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return

    await one()  # connected and warm
    server_before = sum(cpu_seconds(p) or 0.0 for p in server_pids)
    mine, start = os.times(), time.monotonic()
    tasks = []
    for i in range(requests):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)
    server = sum(cpu_seconds(p) or 0.0 for p in server_pids) - server_before
    now = os.times()
    client_s = now.user + now.system - mine.user - mine.system
    await client.close()
    return (f"rate {rate:g}/s, {requests} requests: tritonserver + stub {server / requests * 1e3:.2f} ms, "
            f"client {client_s / requests * 1e3:.2f} ms of CPU per request")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="10,40", help="comma-separated requests/s")
    parser.add_argument("--requests", type=int, default=400, help="requests per rate")
    parser.add_argument("--chunks", type=int, default=3, help="streamed responses before the final flag")
    parser.add_argument("--prompt-words", type=int, default=700, help="the text_input's size in words")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "echo"
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(CONFIG % args.chunks)
        (model / "1" / "model.py").write_text(MODEL)
        ports = ServerPorts(*free_ports(3))
        server = start_server(tmp, ports, log_path=Path(tmp) / "server.log")
        try:
            server.wait_ready(180)
            pids = process_tree(server.process.pid)
            for rate in (float(r) for r in args.rates.split(",")):
                line = asyncio.run(_run(f"127.0.0.1:{ports.grpc}", pids, rate, args.requests,
                                        "word " * args.prompt_words))  # fmt: skip
                print(line, flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
