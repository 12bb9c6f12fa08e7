"""The two workloads beyond the paper's five: multi-turn chat and multi-tenant system
prompts. Their statistics follow the shapes they were designed from, chat turns replay
the conversation so far, and the simulator plays a conversation closed-loop (a turn is
sent only after the previous answer, and finds that answer cached)."""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from client.workloads import Materializer, generate, poisson_arrivals
from preble_backend.common.cost_model import CostModel
from scheduler.e2 import E2
from scheduler.sim.simulator import SimConfig, simulate
from scheduler.sim.sweep import sim_requests
from scheduler.sim.workload_stats import summarize

COST = CostModel.load("mistral7b_a6000")


def conversations(reqs) -> list[list[int]]:
    """Each conversation's requests (indices), first turn first, following ``after``."""
    convs: dict[int, list[int]] = {}
    head: dict[int, int] = {}
    for i, r in enumerate(reqs):
        head[i] = i if r.after is None else head[r.after]
        convs.setdefault(head[i], []).append(i)
    return list(convs.values())


def test_chat_turns_replay_the_conversation_and_follow_the_previous_answer():
    reqs = generate("chat", 600, seed=4)
    assert len(reqs) == 600
    for conv in conversations(reqs):
        first = reqs[conv[0]]
        assert first.after is None and first.think_s == 0
        assert first.segments[0].id.startswith("ct-system-")
        for prev, cur in zip(conv, conv[1:]):
            p, c = reqs[prev], reqs[cur]
            assert c.after == prev and 2 <= c.think_s <= 120
            # the previous prompt, then its answer, then one new user message
            assert c.segments[:-1] == p.segments + [p.answer]
            assert p.answer.length == p.output_len and c.group == p.group


def test_chat_statistics_follow_their_design():
    reqs = generate("chat", 3000, seed=0)
    convs = conversations(reqs)
    assert 4.0 < len(reqs) / len(convs) < 6.5  # turns per conversation, long-tailed around 5
    users = [r.segments[-1].length for r in reqs]
    assert 70 < statistics.mean(users) < 110  # ~90-token user messages
    assert 190 < statistics.mean(r.output_len for r in reqs) < 250  # ~220-token answers
    with_doc = [c for c in convs if reqs[c[0]].group.startswith("doc-")]
    assert 0.33 < len(with_doc) / len(convs) < 0.47  # 40% attach a shared document
    per_doc = Counter(reqs[c[0]].group for c in with_doc).most_common()
    assert per_doc[0][1] >= 3 * per_doc[len(per_doc) // 2][1]  # Zipf: a few documents are hot
    # Table 1's view: nearly every prompt is a shared prefix, the conversation itself
    stats = summarize([Materializer().token_ids(r) for r in reqs[:800]], [r.output_len for r in reqs[:800]])
    assert stats["shared_prefix_pct"][0] > 70


def test_multi_tenant_statistics_follow_llm_ds_shape():
    reqs = generate("multi_tenant", 2000, seed=1)
    assert all(r.after is None for r in reqs)
    tenants = Counter(r.group for r in reqs)
    assert len(tenants) <= 200 and len(tenants) > 150  # n // 10 tenants, nearly all drawn
    contexts = {r.segments[0].id: r.segments[0].length for r in reqs}
    assert 5400 < statistics.mean(contexts.values()) < 6600  # ~6,000-token tenant contexts
    assert 1100 < statistics.mean(r.segments[1].length for r in reqs) < 1300  # ~1,200-token queries
    users = {(r.group, r.segments[1].id.split("-")[4]) for r in reqs}
    assert len(users) <= 5 * len(tenants)  # five users per tenant
    top = tenants.most_common()
    assert top[0][1] > 2 * top[len(top) // 2][1]  # tenants differ in size


def test_shifting_docs_popularity_is_concentrated_within_an_epoch_and_moves_between_them():
    reqs = generate("shifting_docs", 1000, seed=0)
    assert reqs == generate("shifting_docs", 1000, seed=0)  # deterministic by seed
    background = [r for r in reqs if r.group == "background"]
    assert 0.25 < len(background) / len(reqs) < 0.35
    assert len({r.segments[0].id for r in background}) == len(background)  # unshared
    hottest = []
    for epoch in range(10):
        docs = Counter(r.group for r in reqs[epoch * 100 : (epoch + 1) * 100] if r.group != "background")
        top3 = [d for d, _ in docs.most_common(3)]
        assert sum(docs[d] for d in top3) / sum(docs.values()) > 0.4  # a few documents are hot
        hottest.append(set(top3))
    kept = [len(hottest[e] & hottest[e + 1]) for e in range(9)]
    assert sum(kept) <= 4, kept  # and the next epoch's hot set is mostly new
    doc_requests = [r for r in reqs if r.group != "background"]
    assert all(r.segments[0].id == "sd-system" for r in doc_requests)
    assert all(r.segments[1].id.startswith("sd-doc-") for r in doc_requests)
    assert 4000 < sum(r.segments[1].length for r in doc_requests) / len(doc_requests) < 9000


def test_shifting_docs_minute_keeps_its_hot_documents_for_1400_requests():
    """The same generator with epochs of 1,400 requests: the hottest document of the first
    1,400 holds across them (its two halves agree) and gives way at the 1,401st."""
    reqs = generate("shifting_docs_minute", 3000, seed=0)

    def hottest(lo: int, hi: int) -> str:
        return Counter(r.group for r in reqs[lo:hi] if r.group != "background").most_common(1)[0][0]

    assert hottest(0, 700) == hottest(700, 1400) != hottest(1400, 2800)


def test_agentic_trajectories_grow_by_each_action_and_tool_output_while_the_tool_runs():
    reqs = generate("agentic", 600, seed=2)
    followers = [r for r in reqs if r.after is not None]
    assert len(followers) > 0.7 * len(reqs)  # trajectories of several steps
    for r in followers:
        before = reqs[r.after]
        assert r.segments[: len(before.segments)] == before.segments  # the earlier step's prompt
        action, observation = r.segments[len(before.segments) :]
        assert action == before.answer and observation.id.startswith("ag-o-")  # its action, the tool's output
        assert 0.2 <= r.think_s <= 30 and r.group == before.group
    assert all(r.segments[0].id.startswith("ag-tools-") for r in reqs)
    assert all(r.prompt_len + r.output_len <= 32000 for r in reqs)
    assert 1.5 < statistics.mean(r.think_s for r in followers) < 2.6  # tools return in ~2 s
    assert len({r.segments[0].id for r in reqs}) <= 4  # four agent applications' tool prompts


def test_poisson_arrivals_space_conversation_starts_so_the_trace_offers_the_rate():
    reqs = poisson_arrivals(generate("chat", 2000, seed=2), rps=10.0, seed=2)
    starts = [r.arrival for r in reqs if r.after is None]
    rate = len(starts) / starts[-1]
    assert 0.8 < rate * len(reqs) / len(starts) / 10.0 < 1.25
    for r in reqs:
        if r.after is not None:
            assert r.arrival == reqs[r.after].arrival + r.think_s


def test_the_simulator_plays_a_conversation_closed_loop_with_its_answers_cached():
    reqs = poisson_arrivals(generate("chat", 120, seed=5, scale=0.2), rps=4.0, seed=5)
    trace = sim_requests("c", reqs)
    cfg = SimConfig.of(2, capacity_tokens=200_000)
    result = simulate(trace, lambda clock: E2(2, cost_model=COST, clock=clock), cfg, COST)
    rec = result.records
    followed = 0
    for i, r in enumerate(reqs):
        if r.after is None:
            continue
        prev, cur = rec[f"c-{r.after}"], rec[f"c-{i}"]
        assert cur.arrival >= prev.finish + r.think_s - 1e-9  # sent after reading the answer
        if cur.instance == prev.instance:
            followed += 1
            # the previous prompt and its answer (but the last answer token, never computed)
            # are cached there, to the page
            cached_before = reqs[r.after].prompt_len + reqs[r.after].output_len - 1
            assert cur.cached_tokens >= cached_before // 16 * 16
    assert followed > 0.8 * sum(r.after is not None for r in reqs)


def test_a_generated_chat_trace_keeps_its_conversations(tmp_path):
    """``preble workload generate`` writes which row each turn follows, and ``preble
    bench --trace`` reads it back, so a recorded chat trace still plays closed-loop."""
    from client.bench import BenchConfig, build_trace
    from preble_backend.cli import main

    path = tmp_path / "chat.jsonl"
    assert main(["workload", "generate", "--workload", "chat", "--num-requests", "40", "--scale", "0.05",
                 "--output", str(path)]) == 0  # fmt: skip
    reqs = generate("chat", 40, seed=0, scale=0.05)
    played, recorded = build_trace(BenchConfig(trace=str(path), requests=0))
    assert recorded and len(played) == 40
    assert [(p.after, p.think_s) for p in played] == [(r.after, r.think_s) for r in reqs]
    assert any(p.after is not None for p in played)


def test_simulate_runs_chat_at_given_fractions_of_a_given_stress_rate(tmp_path, capsys):
    """``--stress-rps`` skips the search (and the light rate); records name the capacity
    and count the turns that moved."""
    import gzip
    import json

    from preble_backend.cli import main

    assert main(["simulate", "--workload", "chat", "--instances", "2", "--requests", "40",
                 "--stress-rps", "4", "--fractions", "0.5,1", "--policies", "e2,cache_aware",
                 "--capacity-tokens", "30000", "--jobs", "1", "--output", str(tmp_path)]) == 0  # fmt: skip
    records = json.loads(gzip.decompress((tmp_path / "chat_2_kv30k.json.gz").read_bytes()))
    assert sorted({r["rps"] for r in records}) == [2.0, 4.0]
    assert all(r["capacity_tokens"] == 30000 and r["followers"] > 0 for r in records)
    assert all(0 <= r["follower_moves"] <= r["followers"] for r in records)
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "chat", "--fractions", "0,1"])
    assert "'0,1' is not a comma-separated list of fractions in (0, 1]" in capsys.readouterr().err
