"""``preble serve`` with one prefill and one decode CPU engine, each in a tritonserver of
its own (``preble repo --prefill-engines 1 --decode-engines 1``): answers through the
front are the aggregated ones, with the KV moved between the two servers, and a prefill
engine whose server is killed and restarted is paired again (a transient failure does not
end a pair: the restarted engine is a new NIXL peer, never the dead one)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from server_utils import http, metric_value, serve_stack, wait_for, write_test_repository
from test_service import LOOPBACK, listening_addresses

pytest.importorskip("nixl_cu12", reason="KV transfer needs NIXL: pip install 'preble-triton[pd]'")
pytestmark = pytest.mark.server

P, D = "preble_engine_0", "preble_engine_1"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_a_prefill_and_a_decode_engine_serve_and_a_restarted_prefill_engine_is_paired_again(
    tmp_path, tiny_model
):
    stack = serve_stack(write_test_repository(tmp_path / "repo", roles=["prefill", "decode"]))

    def ask(prompt: str, **pins) -> dict:
        body = json.dumps({"text_input": prompt, "parameters": {**GREEDY, **pins}}).encode()
        status, _, answer = http("POST", stack.url("/v2/models/preble/generate"), body)
        assert status == 200, answer
        return json.loads(answer)

    def metric(name: str, label: str) -> float:
        return metric_value(f"http://127.0.0.1:{stack.ports.metrics}", name, label) or 0

    def received() -> float:
        return metric("preble_engine_kv_pages_received_total", f'engine="{D}"')

    def offered() -> float:
        return metric("preble_router_prefill_legs_total", 'outcome="offered"')

    try:
        for turn in ("before", "after"):
            prompt = f"{turn} the restart: " + "a document both engines read. " * 20
            reference = ask(prompt, preble_engine=P)  # aggregated, on the prefill engine
            pages, legs = received(), offered()
            got = ask(prompt, preble_prefill_engine=P)
            assert got["instance"] == D and got["text_output"] == reference["text_output"]
            wait_for(lambda p=pages, n=legs: received() > p and offered() == n + 1, 10, "the KV moved")
            if turn == "before":
                os.kill(stack.engine_stub(P), signal.SIGKILL)
                wait_for(lambda: metric("preble_router_engine_up", f'engine="{P}"') == 0, 30, "P down")
                wait_for(lambda: metric("preble_router_engine_up", f'engine="{P}"') == 1, 120, "P restarted")
        assert metric("preble_engine_kv_transfer_failures_total", f'engine="{D}"') == 0
        addresses = listening_addresses(stack.process.pid)  # UCX's among them: loopback only
        assert addresses and set(addresses) <= LOOPBACK, addresses
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err
    assert f"engine {P} is back" in out, out
