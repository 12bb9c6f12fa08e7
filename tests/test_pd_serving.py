"""Prefill/decode disaggregation through a real tritonserver: a prefill engine and a decode
engine (``preble repo --prefill-engines 1 --decode-engines 1``), KV moved by NIXL.

Every answer after a handoff is the aggregated answer, token for token; only the pages the
decode engine lacks move; a lease that expired and a prefill engine that died both end in
a local prefill with the same answer, and every page comes back."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from server_utils import (
    assert_engine_pages_free,
    client_for,
    http,
    kill_stub_between_sends,
    launch,
    metric_value,
    wait_for,
    write_test_repository,
)

from client.triton_client import PrebleError

pytest.importorskip("nixl_cu12", reason="KV transfer needs NIXL: pip install 'preble-triton[pd]'")
pytestmark = pytest.mark.server

P, D = "preble_engine_0", "preble_engine_1"
PAGE = 16
LEASE_S = 1.0
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    repo = write_test_repository(tmp_path_factory.mktemp("pd") / "repo", roles=["prefill", "decode"],
                                 kv_lease_s=LEASE_S, router_overrides={"health_interval_s": 0.2})  # fmt: skip
    srv = launch(repo, repo.parent / "server.log")
    yield srv
    srv.stop()


def ask(server, prompt: str, params: dict, **pins) -> dict:
    url = f"http://127.0.0.1:{server.ports.http}/v2/models/preble/generate"
    body = json.dumps({"text_input": prompt, "parameters": {**params, **pins}}).encode()
    status, _, answer = http("POST", url, body)
    assert status == 200, answer
    return json.loads(answer)


def run_engine(
    server, engine: str, ids: list[int], params: dict, kv: dict | None = None
) -> tuple[list[int], dict]:
    """A request sent to one engine model as the router sends it: its tokens and final report."""
    inputs = {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_),
        "request_id": np.array([f"t{time.monotonic_ns()}".encode()], dtype=np.object_),
    }
    if kv is not None:
        inputs["kv_transfer"] = np.array([json.dumps(kv).encode()], dtype=np.object_)
    result = client_for(server).infer_grpc(inputs, model=engine, timeout=60)
    tokens = [int(t) for r in result.responses for t in np.asarray(r.get("token_ids", [])).reshape(-1)]
    return tokens, json.loads(result.final["report"])


def kv_stats(server, engine: str) -> dict:
    load = client_for(server).engine_control(engine, "stats")["load"]
    return {k: v for k, v in load.items() if k.startswith("kv_") or k == "role"}


def legs(server, outcome: str = "offered") -> float:
    url = f"http://127.0.0.1:{server.ports.metrics}"
    return metric_value(url, "preble_router_prefill_legs_total", f'outcome="{outcome}"') or 0


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def test_engines_report_their_roles_and_the_router_never_decodes_on_the_prefill_engine(server):
    assert kv_stats(server, P)["role"] == "prefill" and kv_stats(server, D)["role"] == "decode"
    assert kv_stats(server, D)["kv_bytes_per_token"] > 0

    def roles() -> dict:
        return client_for(server).admin("status", server.access.admin_key).get("roles", {})

    wait_for(lambda: roles() == {P: "prefill", D: "decode"}, 10, "the router learns the engines' roles")
    for i in range(4):
        assert ask(server, f"an unpinned request {i} " * 8, GREEDY)["instance"] == D


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_handoff_answers_the_aggregated_text_and_moves_the_whole_prompt_pages(server, params):
    prompt = f"A long shared document, {params['temperature']}: " + "the quick brown fox jumps. " * 20
    reference = ask(server, prompt, params, preble_engine=P)  # aggregated, on the prefill engine
    received = kv_stats(server, D)["kv_pages_received"]
    offered = legs(server)
    got = ask(server, prompt, params, preble_prefill_engine=P)
    assert got["instance"] == D and got["text_output"] == reference["text_output"]
    moved = kv_stats(server, D)["kv_pages_received"] - received
    assert kv_stats(server, D)["kv_transfer_s"] > 0
    assert moved > 0 and moved * PAGE == got["num_cached_tokens"]  # what it decoded from arrived
    wait_for(lambda: legs(server) == offered + 1, 5, "the router counts the prefill leg")
    wait_for(lambda: kv_stats(server, P)["kv_leases"] == 0, 5, "the decode side's notice releases the lease")
    for engine in (P, D):
        assert_engine_pages_free(client_for(server), engine)


def test_only_the_pages_the_decode_engine_lacks_move(server):
    doc = ids(1, 10 * PAGE)
    run_engine(server, D, doc + ids(2, 9), GREEDY)  # the decode engine caches the document
    prompt = doc + ids(3, 2 * PAGE + 5)  # 12 whole pages, the first 10 on D already
    reference, _ = run_engine(server, P, prompt, GREEDY)
    _, leg = run_engine(server, P, prompt, {"max_tokens": 1}, kv={"offer": True})
    offer = leg["kv_offer"]
    assert offer["tokens"] == 12 * PAGE and len(offer["pages"]) == 12
    before = kv_stats(server, D)
    tokens, _ = run_engine(server, D, prompt, GREEDY, kv={"take": offer})
    after = kv_stats(server, D)
    assert tokens == reference
    assert after["kv_pages_received"] - before["kv_pages_received"] == 2
    assert (
        after["kv_takes"] == before["kv_takes"] + 1
        and after["kv_transfer_failures"] == before["kv_transfer_failures"]
    )


def test_an_offer_whose_lease_expired_is_never_decoded_from(server):
    """The prefill side frees the pages once the lease is gone (its cache flushed here): the
    decode side sees their stamps changed, frees what it read and prefills itself."""
    prompt = ids(4, 6 * PAGE + 3)
    _, leg = run_engine(server, P, prompt, {"max_tokens": 1}, kv={"offer": True})
    wait_for(lambda: kv_stats(server, P)["kv_leases"] == 0, 5 * LEASE_S, "the lease expires")
    client_for(server).engine_control(P, "flush_cache")
    reference, _ = run_engine(server, P, prompt, GREEDY)  # its pages again, with new stamps
    before = kv_stats(server, D)
    tokens, _ = run_engine(server, D, prompt, GREEDY, kv={"take": leg["kv_offer"]})
    after = kv_stats(server, D)
    assert tokens == reference
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"] + 1
    assert after["kv_pages_received"] == before["kv_pages_received"]
    assert_engine_pages_free(client_for(server), D)


def test_a_malformed_kv_transfer_is_refused_by_name(server):
    with pytest.raises(PrebleError, match=r"input 'kv_transfer' must be"):
        run_engine(server, D, ids(5, 40), GREEDY, kv={"take": {"pages": [1]}})


def test_a_prefill_engine_the_router_does_not_have_is_refused_by_name(server):
    url = f"http://127.0.0.1:{server.ports.http}/v2/models/preble/generate"
    refusals = [
        ("preble_engine_9", b"preble_prefill_engine='preble_engine_9' is invalid"),
        (7, b"request parameter preble_prefill_engine must be an engine's name"),
    ]
    for bad, problem in refusals:
        body = json.dumps({"text_input": "Hello", "parameters": {**GREEDY, "preble_prefill_engine": bad}})
        status, _, answer = http("POST", url, body.encode())
        assert status == 400 and problem in answer, answer
    assert ask(server, "Hello", GREEDY)["text_output"]  # the router serves on


def test_a_client_that_cancels_mid_handoff_leaves_every_page_back(server):
    """Cancelled while its leg or its transfer runs: the decode engine aborts it at its
    first response, and the prefill side's lease goes with the decode side's notice."""
    client = client_for(server)
    for i, deadline in enumerate((0.05, 0.3)):
        url = f"http://127.0.0.1:{server.ports.http}/v2/models/preble/generate"
        params = {**GREEDY, "max_tokens": 200, "preble_prefill_engine": P}
        body = json.dumps({"text_input": f"cancelled {i}: " + "a long document. " * 60, "parameters": params})
        try:
            http("POST", url, body.encode(), timeout=deadline)
        except OSError:  # the client gave up: its connection closes
            pass
    wait_for(lambda: kv_stats(server, P)["kv_leases"] == 0, 5 * LEASE_S, "every lease is released")
    for engine in (P, D):
        assert_engine_pages_free(client, engine)


def test_a_dead_prefill_engine_costs_a_local_prefill_and_nothing_else(server):
    """Last: the prefill engine's stub is killed after it offered. The decode side's read
    fails at once, and it prefills; then the router routes around the dead engine, and a
    request pinned to prefill there is served whole by the decode engine."""
    prompt = ids(6, 8 * PAGE + 1)
    reference, _ = run_engine(server, P, prompt, GREEDY)
    _, leg = run_engine(server, P, prompt, {"max_tokens": 1}, kv={"offer": True})
    kill_stub_between_sends(client_for(server).engine_control(P, "health")["load"]["pid"])
    before = kv_stats(server, D)
    start = time.monotonic()
    tokens, _ = run_engine(server, D, prompt, GREEDY, kv={"take": leg["kv_offer"]})
    assert tokens == reference and time.monotonic() - start < 10
    assert kv_stats(server, D)["kv_transfer_failures"] == before["kv_transfer_failures"] + 1
    text = "After the prefill engine died: " + "a document. " * 20
    got = ask(server, text, GREEDY, preble_prefill_engine=P)
    assert (
        got["instance"] == D
        and got["text_output"] == ask(server, text, GREEDY, preble_engine=D)["text_output"]
    )
    assert_engine_pages_free(client_for(server), D)


def test_a_dead_decode_engine_s_request_migrates_and_the_prefill_engine_finishes_it(tmp_path, tiny_model):
    """Its own server: the decode engine's stub killed mid-answer. The request goes on from
    its prompt and the tokens already sent on the only engine left, the prefill engine
    (with no engine that decodes up, a role only steers E2), with the undisturbed text."""
    repo = write_test_repository(tmp_path / "repo", roles=["prefill", "decode"],
                                 router_overrides={"health_interval_s": 0.2})  # fmt: skip
    srv = launch(repo, tmp_path / "server.log")
    try:
        client = client_for(srv)
        params = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
        prompt = "A document the decode engine will not finish. " * 10
        reference = ask(srv, prompt, params, preble_engine=P)["text_output"]
        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.update(r=client.stream_grpc(prompt, params, timeout=90))
        )
        thread.start()
        deadline = time.monotonic() + 30
        while client.engine_control(D, "stats")["load"]["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        kill_stub_between_sends(client.engine_control(D, "health")["load"]["pid"])
        thread.join(90)
        assert prompt + result["r"].text == reference and result["r"].final["instance"] == P
        assert_engine_pages_free(client, P)
    finally:
        srv.stop()


def test_tensor_parallel_engines_hand_off_each_rank_s_slice_through_tritonserver(tmp_path, tiny_model):
    """Its own server: a TP-2 prefill engine and a TP-2 decode engine (four processes).
    Each reports its KV cut over two ranks; a handoff answers the aggregated text (greedy
    and seeded), both ranks' halves arrive, and every page comes back on both engines."""
    repo = write_test_repository(tmp_path / "repo", roles=["prefill", "decode"], tensor_parallel_size=2,
                                 router_overrides={"health_interval_s": 0.2})  # fmt: skip
    srv = launch(repo, tmp_path / "server.log")
    try:
        stats = kv_stats(srv, D)
        assert stats["kv_ranks"] == 2 and stats["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4  # K+V, 4 layers
        for params in (GREEDY, SEEDED):
            prompt = f"A document for two ranks, {params['temperature']}: " + "the lazy dog sleeps. " * 20
            reference = ask(srv, prompt, params, preble_engine=P)
            before = kv_stats(srv, D)
            got = ask(srv, prompt, params, preble_prefill_engine=P)
            after = kv_stats(srv, D)
            moved = after["kv_pages_received"] - before["kv_pages_received"]
            assert got["instance"] == D and got["text_output"] == reference["text_output"]
            assert moved > 0 and moved * PAGE == got["num_cached_tokens"]
            nbytes = after["kv_bytes_received"] - before["kv_bytes_received"]
            assert nbytes == moved * PAGE * stats["kv_bytes_per_token"]  # both ranks' halves
            wait_for(lambda: kv_stats(srv, P)["kv_leases"] == 0, 5, "the notice releases the lease")
        for engine in (P, D):
            assert_engine_pages_free(client_for(srv), engine)
    finally:
        srv.stop()


def test_engines_that_both_serve_and_move_kv_hand_off_either_way(tmp_path, tiny_model):
    """Its own server: two engines of the role ``both`` with ``kv_transfer`` (``preble repo
    --kv-transfer``). Each reports the KV it moves; a prompt prefilled on either and
    decoded on the other answers the aggregated text, what the decoding engine lacked
    arrives, and every page and lease comes back on both."""
    repo = write_test_repository(
        tmp_path / "repo", kv_transfer=True, router_overrides={"health_interval_s": 0.2}
    )
    srv = launch(repo, tmp_path / "server.log")
    try:
        for engine in (P, D):
            stats = kv_stats(srv, engine)
            assert stats["role"] == "both" and stats["kv_bytes_per_token"] > 0
        for prefill, decode in ((P, D), (D, P)):
            prompt = f"A document {prefill} prefills for {decode}: " + "the lazy dog sleeps. " * 20
            reference = ask(srv, prompt, GREEDY, preble_engine=prefill)  # aggregated, caches it there
            before = kv_stats(srv, decode)["kv_pages_received"]
            got = ask(srv, prompt, GREEDY, preble_engine=decode, preble_prefill_engine=prefill)
            moved = kv_stats(srv, decode)["kv_pages_received"] - before
            assert got["instance"] == decode and got["text_output"] == reference["text_output"]
            assert moved > 0 and moved * PAGE == got["num_cached_tokens"]
            wait_for(lambda p=prefill: kv_stats(srv, p)["kv_leases"] == 0, 5, "the notice releases the lease")
        for engine in (P, D):
            assert_engine_pages_free(client_for(srv), engine)
    finally:
        srv.stop()
