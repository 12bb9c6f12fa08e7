"""``preble bench --simulate`` with prefill/decode roles: the bench's own requests through
the simulated P/D cluster, as ``preble repo --prefill-engines/--decode-engines`` lays it
out live, so the simulator's TPOT while new documents arrive can be set beside the live
stack's (issue 64's live target)."""

from __future__ import annotations

import json

import pytest

from preble_backend.cli import main
from preble_backend.common.cost_model import CostModel


def test_a_bench_replays_through_simulated_prefill_and_decode_engines(tmp_path, tiny_model):
    code = main(["bench", "--simulate", "2", "--prefill-engines", "1", "--decode-engines", "1",
                 "--capacity-tokens", "32768", "--workload", "shifting_docs", "--requests", "30",
                 "--rates", "4", "--policies", "e2,sglang_pd,dynamo_pd", "--scale", "0.2",
                 "--cost-model", "tiny_cpu", "--tokenizer", tiny_model,
                 "--output", str(tmp_path)])  # fmt: skip
    assert code == 0
    runs = {r["policy"]: r for r in json.loads((tmp_path / "bench_shifting_docs.json").read_text())["runs"]}
    for policy in ("e2", "sglang_pd", "dynamo_pd"):
        run = runs[policy]
        assert run["completed"] == 30
        # every request decodes on the decode instance (the prefill one decodes nothing)
        assert run["per_engine"] == {"instance_1": 30}
        assert run["new_doc_decoding"] > 0 and run["p99_tpot_new_doc_s"] >= run["avg_tpot_new_doc_s"] > 0
    # SGLang's rule sends every prompt the decode instance lacks through the prefill one
    assert runs["sglang_pd"]["branches"].get("pd", 0) > 0 and runs["sglang_pd"]["moved_tokens"] > 0
    # the router's tpot_slo_ms reaches the simulated e2: a bound no local prefill meets
    # leaves on the decode instance only prompts that arrive while nothing decodes there
    code = main(["bench", "--simulate", "2", "--prefill-engines", "1", "--decode-engines", "1",
                 "--capacity-tokens", "32768", "--workload", "shifting_docs", "--requests", "30",
                 "--rates", "4", "--policies", "e2", "--scale", "0.2", "--cost-model", "tiny_cpu",
                 "--tokenizer", tiny_model, "--tpot-slo-ms", "0.001",
                 "--output", str(tmp_path / "slo")])  # fmt: skip
    assert code == 0
    bounded = json.loads((tmp_path / "slo" / "bench_shifting_docs.json").read_text())["runs"][0]
    assert bounded["branches"]["disaggregate"] > runs["e2"]["branches"]["disaggregate"]


def test_the_simulated_link_moves_the_kv_a_live_engine_holds(tiny_model):
    """The simulated transfer's bytes per token are the ones a CPU engine of this model
    reports (fp32 K and V of every layer), the ones E2 learns live."""
    from preble_backend.engine.config import EngineConfig
    from preble_backend.engine.engine import Engine
    from scheduler.sim.replay import kv_bytes_per_token

    engine = Engine(EngineConfig(model_path=tiny_model, max_num_tokens=1024))
    try:
        live = engine.runner.kv_bytes_per_token()
    finally:
        engine.shutdown()
    assert kv_bytes_per_token(tiny_model, CostModel.load("tiny_cpu")) == live


@pytest.mark.parametrize(
    "prefill, decode, message",
    [(2, 1, "--prefill-engines 2 and --decode-engines 1 need that many of the --simulate 2 instances"),
     (0, 2, "decode engines without a prefill role anywhere"), (-1, 2, "--prefill-engines -1")],
)  # fmt: skip
def test_roles_the_simulated_cluster_cannot_take_are_refused_by_name(tmp_path, tiny_model, capsys, prefill,
                                                                     decode, message):  # fmt: skip
    code = main(["bench", "--simulate", "2", "--prefill-engines", str(prefill),
                 "--decode-engines", str(decode), "--workload", "shifting_docs", "--requests", "4",
                 "--rates", "1", "--tokenizer", tiny_model, "--output", str(tmp_path)])  # fmt: skip
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bench_shifting_docs.json").exists()


def test_a_bench_replays_through_simulated_engines_that_both_serve_and_move_kv(tmp_path, tiny_model):
    """``--kv-transfer`` lays the simulated instances out as ``preble repo --kv-transfer``
    does live: every instance ``both``, any two paired by E2 where the price says so
    (``test_disagg``), besides roles where they are given; and the bench runs on them."""
    from preble_backend.cli.commands import sim_roles

    assert sim_roles(2, 0, 0) == () and sim_roles(2, 0, 0, kv_transfer=True) == ("both", "both")
    assert sim_roles(3, 1, 1, kv_transfer=True) == ("prefill", "decode", "both")
    code = main(["bench", "--simulate", "2", "--kv-transfer", "--capacity-tokens", "32768",
                 "--workload", "shifting_docs", "--requests", "30", "--rates", "4", "--policies", "e2",
                 "--scale", "0.2", "--cost-model", "tiny_cpu", "--tokenizer", tiny_model,
                 "--output", str(tmp_path)])  # fmt: skip
    assert code == 0
    run = json.loads((tmp_path / "bench_shifting_docs.json").read_text())["runs"][0]
    assert run["completed"] == 30 and set(run["per_engine"]) == {"instance_0", "instance_1"}
