"""E2's online cost model (issue 63): the engine's pass statistics, the router's fit per
engine from them (window, prior, outliers, fallbacks), the prior for an engine, E2 pricing
each instance with its own model (choices computed by hand), and the engine's report."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from test_e2 import Clock, req, stored

from preble_backend.common.cost_model import CostModel, nnls
from preble_backend.common.pass_costs import PassCosts
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.model_card import model_card
from preble_backend.model.pypi_models import tiny_model_path
from scheduler.calibration import OnlineCost
from scheduler.cost_priors import TYPICAL_DECODE, Prior, check_setting, describe, estimate, prior_for
from scheduler.e2 import E2
from scheduler.policy import InstanceLoad

TRUE = CostModel(base_ms=20.0, prefill_ms_per_token=0.1, decode_ms_per_request=0.5,
                 attention_ms_per_context_token=0.001, decode_step_ms=0.0)  # fmt: skip
WRONG = CostModel(base_ms=0.0, prefill_ms_per_token=1.0, decode_ms_per_request=0.05,
                  attention_ms_per_context_token=0.0, decode_step_ms=30.0, source="wrong")  # fmt: skip
TERMS = ("base_ms", "prefill_ms_per_token", "decode_ms_per_request", "attention_ms_per_context_token")


def passes(engine: PassCosts, cost: CostModel, n: int, seed: int = 0, noise: float = 0.0) -> None:
    """``n`` passes as a serving engine runs them: prefill chunks, decode batches, both."""
    rng = random.Random(seed)
    for _ in range(n):
        prefill = rng.choice((0, 0, rng.randint(16, 2048)))
        decodes = rng.randint(0 if prefill else 1, 32)
        context = prefill + decodes * rng.randint(64, 4096)
        ms = cost.iteration_time(prefill, decodes, context) * (1 + rng.gauss(0, noise))
        engine.add((prefill, decodes, context, 0, 0), ms)


def online(prior: CostModel = WRONG, **kw) -> OnlineCost:
    return OnlineCost(Prior(prior, "the prior", "mismatch"), **kw)


def coefficients(model: CostModel) -> np.ndarray:
    return np.array([getattr(model, t) for t in TERMS])


def test_exact_passes_are_learnt_exactly_whatever_the_prior():
    engine, fit = PassCosts(), online()
    passes(engine, TRUE, 400)
    assert fit.observe({"eager": engine.report()["eager"]})
    assert fit.fit.status == "learnt" and fit.fit.error < 1e-6 and fit.fit.prior_error > 0.5
    assert coefficients(fit.fit.model) == pytest.approx(coefficients(TRUE), rel=1e-4)
    batch, context = TYPICAL_DECODE  # DECODETIME's step, as preble profile times it
    assert fit.fit.model.decode_step_ms == pytest.approx(TRUE.iteration_time(0, batch, batch * context))


def test_a_term_the_passes_never_exercise_keeps_the_priors_value():
    """Engines without a host tier never copy between tiers: what such a copy costs is the
    prior's alone to say, whether the prior prices the rest 10x high or 10x low. (The
    prior's copy inside a whole decode pass had the copy term absorb the pass's error:
    priced high, 10x and more its value; priced low, zero.)"""
    copies = replace(TRUE, load_ms_per_token=0.002)
    for factor in (10.0, 0.1):
        prior = copies.scaled(factor)
        engine, fit = PassCosts(), online(prior)
        passes(engine, TRUE, 400)
        fit.observe({"eager": engine.report()["eager"]})
        assert fit.fit.status == "learnt"
        assert coefficients(fit.fit.model) == pytest.approx(coefficients(TRUE), rel=1e-3)
        assert fit.fit.model.load_ms_per_token == pytest.approx(prior.load_ms_per_token, rel=1e-3)


def test_a_few_outliers_do_not_swing_the_fit():
    """Host pauses: 2% of passes take 10x. The engine weighs them down (Huber); the plain
    least-squares fit of the same passes is swung, so the test can fail."""
    engine, rows, times = PassCosts(), [], []
    rng = random.Random(1)
    for i in range(2000):
        prefill = rng.choice((0, rng.randint(16, 1024)))
        decodes = rng.randint(0 if prefill else 1, 32)
        context = prefill + decodes * rng.randint(64, 2048)
        ms = TRUE.iteration_time(prefill, decodes, context) * (10 if i % 50 == 49 else 1 + rng.gauss(0, 0.02))
        engine.add((prefill, decodes, context, 0), ms)
        rows.append((1.0, prefill, decodes, context))
        times.append(ms)
    fit = online()
    fit.observe(engine.report())
    assert fit.fit.outliers >= 35
    x, y = np.array(rows), np.array(times)
    swung = nnls(x.T @ x, x.T @ y, float(y @ y))[0]
    assert np.max(np.abs(swung / coefficients(TRUE) - 1)) > 0.15
    assert coefficients(fit.fit.model) == pytest.approx(coefficients(TRUE), rel=0.08)


def test_the_fit_minimizes_relative_errors_so_a_long_prefill_does_not_outweigh_the_decodes():
    """CPU-like passes: 0.5-8 s prefills beside ~100 ms decodes, 15% noise. Over eight
    traces the online fit prices a one-request decode within 5%; the least-squares fit in
    milliseconds of the same passes misses it by more than 20% in some (its base and
    per-request terms are set by the prefills' noise), so the test can fail."""
    cpu = CostModel(base_ms=50.0, prefill_ms_per_token=4.0, decode_ms_per_request=5.0,
                    attention_ms_per_context_token=0.02, decode_step_ms=0.0)  # fmt: skip
    true, ours, absolute = cpu.iteration_time(0, 1, 1024), [], []
    for seed in range(8):
        rng, engine, rows, times = random.Random(seed), PassCosts(), [], []
        for _ in range(600):
            prefill = rng.choice((0, 0, 0, rng.randint(256, 2048)))
            decodes = rng.randint(0 if prefill else 1, 4)
            context = prefill + decodes * rng.randint(512, 2048)
            ms = cpu.iteration_time(prefill, decodes, context) * (1 + rng.gauss(0, 0.15))
            engine.add((prefill, decodes, context, 0), ms)
            rows.append((1.0, prefill, decodes, context))
            times.append(ms)
        fit = online()
        fit.observe(engine.report())
        ours.append(fit.fit.model.iteration_time(0, 1, 1024) / true - 1)
        x, y = np.array(rows), np.array(times)
        beta = nnls(x.T @ x, x.T @ y, float(y @ y))[0]
        absolute.append((beta[0] + beta[2] + 1024 * beta[3]) / true - 1)
    assert max(map(abs, ours)) < 0.05 and max(map(abs, absolute)) > 0.2


def test_too_few_passes_or_a_singular_design_fall_back_to_the_prior_and_say_why():
    engine, fit = PassCosts(), online(min_passes=50, refit_passes=8)
    passes(engine, TRUE, 20)
    fit.observe(engine.report())
    assert (fit.fit.status, fit.fit.model) == (
        "prior",
        WRONG,
    ) and "too few passes (20 of 50)" in fit.fit.reason
    same, fit = PassCosts(), online(refit_passes=8)
    for _ in range(200):  # one decode of one request, over and over: base and decode are one
        same.add((0, 1, 100, 0), TRUE.iteration_time(0, 1, 100))
    fit.observe(same.report())
    assert fit.fit.status == "prior" and fit.fit.reason.startswith("singular design")
    # the prior's shape, scaled to the one shape of pass it saw: that pass priced right
    factor = fit.fit.model.decode_ms_per_request / WRONG.decode_ms_per_request
    assert coefficients(fit.fit.model) == pytest.approx(coefficients(WRONG.scaled(factor)), rel=1e-9)
    assert fit.fit.model.iteration_time(0, 1, 100) == pytest.approx(TRUE.iteration_time(0, 1, 100), rel=1e-6)


def test_the_window_follows_an_engine_that_slows_down_and_survives_a_restart():
    engine, fit = PassCosts(), online(window_passes=500)
    passes(engine, TRUE, 600, seed=2)
    fit.observe(engine.report())
    slow = TRUE.scaled(2)
    for k in range(6):  # reports every 500 passes, as probes come
        passes(engine, slow, 500, seed=10 + k)
        fit.observe(engine.report())
    assert coefficients(fit.fit.model) == pytest.approx(coefficients(slow), rel=0.05)
    restarted = PassCosts()  # the engine restarted: its sums start again from zero
    passes(restarted, TRUE, 100, seed=3)
    fit.observe(restarted.report())
    assert fit.windows["eager"].w > 0 and fit.fit.status == "learnt"


def test_graph_replays_are_fitted_apart_for_the_decode_terms():
    engine, fit = PassCosts(), online()
    passes(engine, TRUE, 400)
    graph = replace(TRUE, base_ms=5.0, decode_ms_per_request=0.2)
    rng = random.Random(4)
    for _ in range(300):
        decodes = rng.randint(1, 32)
        context = decodes * rng.randint(64, 4096)
        engine.add((0, decodes, context, 0), graph.iteration_time(0, decodes, context), graph=True)
    fit.observe(engine.report())
    model = fit.fit.model
    assert model.base_ms == pytest.approx(20.0, rel=1e-3) and model.prefill_ms_per_token == pytest.approx(0.1)
    assert model.decode_ms_per_request == pytest.approx(0.2, rel=1e-3)
    assert model.decode_step_ms == pytest.approx(graph.iteration_time(0, 16, 16 * 512), rel=1e-3)


def test_the_prior_is_a_fit_of_this_model_and_device_else_an_estimate_else_named():
    tiny = model_card("tiny", tiny_model_path()).cost_facts("cpu", 1, 2)
    assert prior_for(tiny).kind == "matches" and prior_for(tiny).model == CostModel.load("tiny_cpu")
    assert prior_for({**tiny, "device": "H100"}).kind == "estimate"
    assert prior_for(tiny, "mistral7b_a6000").kind == "mismatch"
    emulated = {"emulated": "mistral7b_a6000", "slowdown": 2.0}
    assert prior_for(emulated).model == CostModel.load("mistral7b_a6000").scaled(2.0)
    # the engine's own fit named in the router: the engine waits it out twice as slowly
    assert prior_for(emulated, "mistral7b_a6000").model == prior_for(emulated).model
    assert prior_for(emulated, "tiny_cpu").kind == "mismatch"
    # Mistral-7B's shape on one H100 in bf16, worked out from the device table by hand
    facts = {"model": "mistral L32 H4096 A32/8x128 I14336 V32000", "device": "H100", "tensor_parallel": 1,
             "dtype_bytes": 2, "parameters": 7_241_732_096, "kv_bytes_per_token": 131072}  # fmt: skip
    guess = estimate(facts)
    assert guess.base_ms == pytest.approx(7_241_732_096 * 2 / 3.35e12 * 1e3 + 32 * 0.05)
    assert guess.prefill_ms_per_token == pytest.approx(2 * 7_241_732_096 / 5e14 * 1e3)
    assert guess.attention_ms_per_context_token == pytest.approx(131072 / 3.35e12 * 1e3)
    shipped = CostModel.load("mistral7b_a6000")  # the paper's A6000 fit, against the A6000 estimate
    a6000 = estimate({**facts, "device": "A6000"})
    assert 0.5 < a6000.prefill_time(2048) / shipped.prefill_time(2048) < 2


def test_settings_and_what_repo_says():
    for good in ("auto", "auto:tiny_cpu", "tiny_cpu"):
        check_setting(good)
    with pytest.raises(ValueError, match="'nope' is invalid"):
        check_setting("auto:nope")
    smollm2 = {"model": "llama L30 H576 A9/3x64 I1536 V49152", "device": "cpu", "tensor_parallel": 1}
    line, warning = describe("tiny_cpu", smollm2)
    assert "fixed, never learnt" in line and "another model's or device's timings" in warning
    assert describe("auto", smollm2)[1] is None and "learnt online" in describe("auto", smollm2)[0]
    assert "until the online fit takes over" in describe("auto:tiny_cpu", smollm2)[1]


SLOW = replace(TRUE, base_ms=80.0, prefill_ms_per_token=0.4)


def e2(costs, **kw) -> E2:
    return E2(2, costs, 100_000, clock=Clock(), page_size=1, th_bal=float("inf"), **kw)


def test_e2_prices_each_instance_with_its_own_costs():
    """Instance 0 caches 30 of a 100-token prompt (30 < 70 missed: explore). Priced alike,
    instance 0 costs P = 20 + 70 * 0.1 = 27 ms, instance 1 P = 20 + 100 * 0.1 = 30 ms: 0.
    With instance 0 four times slower, 80 + 70 * 0.4 = 108 ms against 30: instance 1."""
    for costs, expected in (([TRUE, TRUE], 0), ([SLOW, TRUE], 1)):
        policy = e2(costs)
        first = req(range(30))
        policy.record(first, 0)
        policy.on_finish(0, first, stored(range(30)))
        decision = policy.select(req(list(range(30)) + [7] * 70), [InstanceLoad(), InstanceLoad()])
        assert (decision.instance, decision.branch) == (expected, "explore")


def test_e2_calibrating_learns_that_an_instance_is_slow_and_moves_its_choice():
    policy = e2(TRUE, calibrate=True)
    facts = {"model": "m", "device": "cpu", "tensor_parallel": 1}
    for i, cost in enumerate((SLOW, TRUE)):
        engine = PassCosts()
        passes(engine, cost, 300, seed=i)
        policy.calibrate(i, {"cost_facts": facts, "pass_costs": engine.report()})
    assert [f.status for f in policy.cost_fits()] == ["learnt", "learnt"]
    assert policy.costs[0].prefill_ms_per_token == pytest.approx(0.4, rel=1e-3)
    first = req(range(30))
    policy.record(first, 0)
    policy.on_finish(0, first, stored(range(30)))
    policy.shadow = [SLOW, TRUE]  # the simulator's comparison with the true costs
    decision = policy.select(req(list(range(30)) + [7] * 70), [InstanceLoad(), InstanceLoad()])
    assert decision.instance == 1 and policy.agreement == [(1, True)]


def test_a_learnt_fit_reprices_the_load_its_instance_carries():
    """A 100-token prompt routed to instance 0 under the prior SLOW counts 80 + 100 * 0.4 =
    120 ms of prefill in its load; once the engine's passes teach TRUE, the next decision
    counts it at 20 + 100 * 0.1 = 30 ms (kept at 120 for the window's 180 s, the prior's
    price outweighed the learnt one's). Instance 1, whose fit did not change, keeps its own."""
    policy = e2(SLOW, calibrate=True)
    facts = {"model": "m", "device": "cpu", "tensor_parallel": 1}
    for i in range(2):  # on other devices: no peers (below)
        policy.calibrate(i, {"cost_facts": {**facts, "device": f"cpu{i}"}})
    assert not policy.repricing  # the prior it was given: nothing priced otherwise
    routed = [req(range(100 * i, 100 * i + 100)) for i in range(2)]
    for i, request in enumerate(routed):
        policy.record(request, i)
    history = policy.history
    assert [h.prefill_ms for h in history] == [120.0, 120.0] and history[0].in_flight_prefill_ms == 120.0
    engine = PassCosts()
    passes(engine, TRUE, 300)
    policy.calibrate(0, {"pass_costs": engine.report()})
    assert policy.cost_fits()[0].status == "learnt" and policy.repricing == {0}
    assert history[0].prefill_ms == 120.0  # repriced on the requests' side, not the probe's
    policy.select(req(range(500, 520)), [InstanceLoad(), InstanceLoad()])
    assert not policy.repricing
    assert history[0].routed[0][1] == pytest.approx(30.0, rel=1e-3)
    assert history[0].in_flight[routed[0].request_id][0] == pytest.approx(30.0, rel=1e-3)
    assert history[1].routed[0][1] == 120.0
    passes(engine, TRUE, 300, seed=1)  # a refit that moves no price by 2%: no walk of the window
    policy.calibrate(0, {"pass_costs": engine.report()})
    assert policy.costs[0] is not policy.priced_with[0] and not policy.repricing


def test_an_engine_still_at_its_prior_is_priced_with_a_peers_learnt_fit():
    """Engines 0-2 serve one model on one device, engine 3 on another. Engine 0 learns TRUE;
    1 and 2, no passes yet, are priced with it: at the prior a 100-token prefill costs them
    120 ms against their peer's 30, and E2 would send them nothing to learn from. Engine 3
    keeps its prior. Engine 1 then learns its own (SLOW), and 2 takes the more practised."""
    policy = E2(4, SLOW, 100_000, clock=Clock(), page_size=1, calibrate=True)
    facts = {"model": "m", "device": "cpu", "tensor_parallel": 1}
    for i in range(4):
        policy.calibrate(i, {"cost_facts": {**facts, "device": "cpu" if i < 3 else "gpu"}})
    engines = [PassCosts(), PassCosts()]
    passes(engines[0], TRUE, 300)
    assert policy.calibrate(0, {"pass_costs": engines[0].report()})
    fits = policy.cost_fits()
    assert [f.status for f in fits] == ["learnt", "peer", "peer", "prior"]
    assert policy.costs[1] is policy.costs[2] is fits[0].model and policy.costs[3] is SLOW
    assert "instance 0's learnt fit" in fits[1].reason and not fits[1].mismatch and fits[3].mismatch
    assert policy.repricing == {0, 1, 2}
    passes(engines[1], SLOW, 400, seed=1)
    policy.calibrate(1, {"pass_costs": engines[1].report()})
    assert [f.status for f in policy.cost_fits()] == ["learnt", "learnt", "peer", "prior"]
    assert policy.costs[1].prefill_ms_per_token == pytest.approx(0.4, rel=1e-3)
    assert policy.costs[2] is policy.costs[1] and policy.costs[0].prefill_ms_per_token == pytest.approx(0.1)


def test_the_window_and_the_requests_in_flight_are_repriced_alike():
    """Two requests, one a prefill leg with 32 tokens loaded from the host tier, at a
    price of 1 ms a prefilled token and 0.5 a loaded one; repriced at 2 and 0.25."""
    from scheduler.load_cost import InstanceHistory

    h = InstanceHistory(180.0)
    h.add("a", 0.0, 70.0, 0.3, 100, True, (70, 0))
    h.add("b", 0.0, 66.0, 0.5, 100, False, (50, 32))
    sums = (h.prefill_ms, h.in_flight_prefill_ms, h.legs_prefill_ms, h.backlog_ms)
    assert sums == (136.0, 136.0, 66.0, 136.0)
    h.reprice(lambda prefilled, loaded: 2.0 * prefilled + 0.25 * loaded)
    assert (h.prefill_ms, h.in_flight_prefill_ms, h.legs_prefill_ms) == (248.0, 248.0, 108.0)
    assert h.backlog_ms == pytest.approx(248.0) and h.in_flight["b"][1:4] == (0.5, 100, False)
    h.finish("b")
    assert (h.in_flight_prefill_ms, h.legs_prefill_ms, h.in_flight_legs) == (140.0, 0.0, 0)


def test_a_fixed_fit_says_whether_it_suits_the_engine(caplog):
    policy = E2(1, "tiny_cpu")
    policy.calibrate(0, {"cost_facts": {"model": "llama L30 H576 A9/3x64 I1536 V49152", "device": "cpu"}})
    fit = policy.cost_fits()[0]
    assert (fit.status, fit.prior_kind, fit.mismatch) == ("fixed", "mismatch", True)
    assert "another model's or device's timings" in caplog.text
    assert policy.costs[0] == CostModel.load("tiny_cpu")  # never learnt
    # an emulated engine waiting out the fit named, 4x slower: priced as it waits, as the simulator does
    policy = E2(1, "mistral7b_a6000")
    policy.calibrate(0, {"cost_facts": {"emulated": "mistral7b_a6000", "slowdown": 4.0}})
    assert policy.costs[0] == CostModel.load("mistral7b_a6000").scaled(4.0)
    assert policy.cost_fits()[0].status == "fixed"


def test_the_engine_reports_each_pass_and_what_it_serves():
    engine = Engine(EngineConfig(model_path=tiny_model_path(), max_num_tokens=4096, chunk_size=64))
    calls = []
    forward = engine.runner.forward
    engine.runner.forward = lambda *a: calls.append(1) or forward(*a)
    engine.generate([[5] * 150, [7] * 40], {"max_tokens": 12, "ignore_eos": True})
    report = engine.cost_report()
    sums = report["pass_costs"]["eager"]
    # one row per pass, each of weight 1 and divided by its own time (no running fit yet)
    assert sums["n"] == len(calls) == sums["w"] == pytest.approx(sums["yty"]) and sums["xtx"][0] > 0
    assert set(report["pass_costs"]) == {"eager"}  # no CUDA graph on the CPU
    assert report["cost_facts"] == model_card("tiny", tiny_model_path(), "float32").cost_facts(
        "cpu", 1, report["cost_facts"]["cores"]
    )


def test_agreement_holds_from_the_first_window_after_which_every_window_agrees():
    from scheduler.sim.calibration_bench import agree_from

    flags = [False] * 60 + [True] * 100  # a window of 50 agrees at 90% from index 55 on
    assert agree_from([(2 * i, ok) for i, ok in enumerate(flags)]) == 110
    assert agree_from([(i, i % 5 != 0) for i in range(200)]) is None  # 80%: never


def test_a_bench_run_again_for_one_policy_takes_the_records_rates_and_replaces_its_runs():
    from scheduler.sim.calibration_bench import merge, stress_of

    cell = {"scenario": "off10", "workload": "chat", "requests": 3200}
    earlier = [{**cell, "stress_fraction": f, "rps": 7.6 * f, "policy": p, "per_seed": [p]}
               for f in (0.5, 1.0) for p in ("e2_true", "e2_online")]  # fmt: skip
    earlier.append({"scenario": "off10", "workload": "loogle", "requests": 1600, "not_run": "a burst"})
    assert stress_of(earlier) == {("chat", "off10"): (7.6, 3200)}
    again = {**cell, "stress_fraction": 1.0, "rps": 7.6, "policy": "e2_online", "per_seed": ["again"]}
    merged = merge(earlier, [again])
    assert len(merged) == 5 and merged[3] is again and merged[:3] == earlier[:3]


def test_the_simulator_prices_a_mixed_cluster_and_e2_learns_it():
    """Two fast and two slow instances, E2 starting from the fast ones' fit: the slow ones
    run their passes at twice the time and report another device (no peer lends across the
    two), and E2's fits of them come out at the truth."""
    from scheduler.sim.calibration_bench import _run, scenario

    truth, prior = scenario("mixed")
    record = _run(("toolbench", 240, 0, 4.0, "mixed", "e2_online", 100))
    learnt = [f["prefill_ms_per_token"] for f in record["fits"]]
    assert [f["status"] for f in record["fits"]] == ["learnt"] * 4
    assert learnt == pytest.approx([t.prefill_ms_per_token for t in truth], rel=0.02)
    assert prior.prefill_ms_per_token == truth[0].prefill_ms_per_token != truth[2].prefill_ms_per_token
    assert truth[0].device == prior.device != truth[2].device == truth[3].device
    assert record["agreement_after"] > 0.9 and record["num_requests"] == 140
