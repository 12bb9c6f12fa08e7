"""The references every policy is read against (``scheduler/sim/reference.py``), checked
on traces whose answers are computed here by hand from the cost model."""

from __future__ import annotations

import pytest

from preble_backend.common.cost_model import CostModel
from scheduler.sim.reference import alone_ms, lower_bound, over_reference, perfect_placement, pooled
from scheduler.sim.simulator import SimConfig, SimRequest, metrics

# base 1 ms, 0.1 ms per prefill token, 2 ms per decode, 0.01 ms per context token
COST = CostModel(base_ms=1.0, prefill_ms_per_token=0.1, decode_ms_per_request=2.0,
                 attention_ms_per_context_token=0.01, decode_step_ms=3.0)  # fmt: skip


def test_a_request_alone_is_charged_chunk_by_chunk_then_decode_by_decode():
    # prompt 10, chunks of 4: 4 tokens (context 4), 4 (context 8), 2 (context 10)
    ttft = (1 + 0.4 + 0.04) + (1 + 0.4 + 0.08) + (1 + 0.2 + 0.10)
    decodes = (1 + 2 + 0.11) + (1 + 2 + 0.12)  # two more output tokens over contexts 11, 12
    assert alone_ms(10, 0, 3, 4, COST) == pytest.approx((ttft, ttft + decodes))
    assert alone_ms(10, 8, 1, 4, COST) == pytest.approx((1 + 0.2 + 0.10,) * 2)  # two pages cached
    # the whole prompt cached: its last token is computed anyway, as a decode
    assert alone_ms(10, 10, 1, 4, COST) == pytest.approx((1 + 2 + 0.10,) * 2)


def test_the_lower_bound_caches_whole_pages_an_earlier_request_left():
    cfg = SimConfig.of(2, 1024, page_size=4, chunk_size=4)
    shared = [7, 7, 7, 7, 8, 8]  # one whole page, then two tokens of the next
    first = SimRequest("a", 0.0, [*shared, 1, 1], 1)
    second = SimRequest("b", 5.0, [*shared, 2, 2], 1)  # shares page 1 only: page 2 differs
    unrelated = SimRequest("c", 6.0, [9] * 8, 1)
    result = lower_bound([second, unrelated, first], cfg, COST)  # arrival order is the bound's own
    a = (1 + 0.4 + 0.04) + (1 + 0.4 + 0.08)  # 8 tokens in two chunks, one output token
    b = 1 + 0.4 + 0.08  # the first page cached: four tokens over a context of 8
    assert result["avg_latency_s"] == pytest.approx((a + b + a) / 3 / 1000)
    assert result["cache_hit_ratio"] == pytest.approx(4 / 24)


def test_a_follower_finds_its_predecessors_answer_cached():
    cfg = SimConfig.of(1, 1024, page_size=4, chunk_size=8)
    turn1 = SimRequest("t1", 0.0, [1, 2, 3, 4], 4, output_ids=[5, 6, 7, 8])
    turn2 = SimRequest("t2", 0.0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 1, after="t1", think_s=1.0)
    result = lower_bound([turn1, turn2], cfg, COST)
    t1 = (1 + 0.4 + 0.04) + sum(1 + 2 + 0.01 * (4 + j) for j in (1, 2, 3))
    t2 = 1 + 0.4 + 0.12  # prompt and answer cached: two pages; four tokens over 12
    assert result["avg_latency_s"] == pytest.approx((t1 + t2) / 2 / 1000)


def test_perfect_placement_is_one_instance_with_the_clusters_budgets_and_speed():
    cfg = SimConfig.of(2, 1024, page_size=4, chunk_size=4)
    one, faster = pooled(cfg, COST)
    assert (one.num_instances, one.capacity_tokens, one.engine.chunk_size) == (1, 2048, 8)
    assert one.engine.max_running_requests == 2 * cfg.engine.max_running_requests
    assert faster.base_ms == 1.0 and faster.prefill_ms_per_token == pytest.approx(0.05)
    assert faster.decode_ms_per_request == 1.0 and faster.attention_ms_per_context_token == 0.005
    # one request of 10 prompt tokens and 3 output tokens, chunks of 8 at half the cost per token
    ttft = (1 + 0.4 + 0.04) + (1 + 0.1 + 0.05)
    total = ttft + (1 + 1 + 0.055) + (1 + 1 + 0.06)
    run = metrics(perfect_placement([SimRequest("r", 0.0, list(range(10)), 3)], cfg, COST))
    assert run["avg_ttft_s"] == pytest.approx(ttft / 1000)
    assert run["avg_latency_s"] == pytest.approx(total / 1000)


def test_every_record_is_read_against_the_reference_at_its_rate():
    records = [{"policy": "reference", "rps": 1.0, "avg_latency_s": 2.0},
               {"policy": "e2", "rps": 1.0, "avg_latency_s": 2.2},
               {"policy": "e2", "rps": 2.0, "avg_latency_s": 9.0}]  # fmt: skip
    over_reference(records)
    assert records[1]["avg_latency_s_over_reference"] == pytest.approx(1.1)
    assert records[0]["avg_latency_s_over_reference"] == 1.0
    assert "avg_latency_s_over_reference" not in records[2]  # no reference at that rate
