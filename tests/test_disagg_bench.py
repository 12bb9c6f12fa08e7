"""The P/D bench's record: runs at the loads an earlier record found, and more traces
added to one (``scheduler/sim/disagg_bench.py``)."""

from __future__ import annotations

import gzip
import json

import pytest

from scheduler.sim.disagg_bench import bench, merge, stress_of


def test_the_bench_runs_at_the_stress_rates_an_earlier_record_found(tmp_path):
    """``--stress-from``: each cell runs at the rate and trace length the record ran at
    (its full-load cell; half of it for the half-load one), a cell it did not run is not
    run again, and a cell it lacks is searched. With no seeds the bench writes the rates
    alone, for a later run."""
    record = tmp_path / "disagg_nvlink.json.gz"
    cells = [{"cluster": "70b_tp4", "workload": "toolbench", "fraction": f, "rps": 3.0 * f, "requests": 12}
             for f in (0.5, 1.0)]  # fmt: skip
    cells.append({"cluster": "70b_tp4", "workload": "loogle", "requests": 24, "not_run": "too few"})
    with gzip.open(record, "wt") as f:
        json.dump({"cells": cells}, f)
    known = stress_of(record)
    assert known == {("70b_tp4", "toolbench"): (3.0, 12, ""), ("70b_tp4", "loogle"): (None, 24, "too few")}
    out = bench(["70b_tp4"], "nvlink", ["toolbench", "loogle"], 12, 1, 1, policies=("e2",), known=known)
    ran = sorted((c["fraction"], c["rps"], c["requests"]) for c in out if "not_run" not in c)
    assert ran == [(0.5, 1.5, 12), (1.0, 3.0, 12)]
    assert [(c["workload"], c["not_run"]) for c in out if "not_run" in c] == [("loogle", "too few")]
    searched = bench(["70b_tp4"], "nvlink", ["toolbench", "loogle"], 12, 0, 1, known=known)  # --seeds 0
    with gzip.open(record, "wt") as f:
        json.dump({"cells": searched}, f)
    assert stress_of(record) == known and all(not c.get("policies") for c in searched)  # the rates, no runs


def test_more_traces_join_a_record_cell_by_cell_and_only_at_its_loads(tmp_path):
    """A second run's traces follow the first's in each cell (five traces from runs of
    three and two); a run at another rate, or of other policies, is refused by name."""
    known = {("70b_tp4", "toolbench"): (3.0, 12, "")}
    first = bench(["70b_tp4"], "nvlink", ["toolbench"], 12, 1, 1, policies=("e2", "sglang_pd"), known=known)
    later = bench(["70b_tp4"], "nvlink", ["toolbench"], 12, 1, 1, policies=("e2", "sglang_pd"), known=known,
                  first_seed=1)  # fmt: skip
    merged = merge(first, later)
    seeds = [
        (c["fraction"], {p: [r["seed"] for r in runs] for p, runs in c["policies"].items()}) for c in merged
    ]
    assert seeds == [(0.5, {"e2": [0, 1], "sglang_pd": [0, 1]}), (1.0, {"e2": [0, 1], "sglang_pd": [0, 1]})]
    assert merged[0]["policies"]["e2"][1] != merged[0]["policies"]["e2"][0]  # another trace
    elsewhere = [{**c, "rps": 2 * c["rps"]} for c in later]
    with pytest.raises(ValueError, match="cannot join"):
        merge(first, elsewhere)
    with pytest.raises(ValueError, match="cannot join"):
        merge(first, [{**c, "policies": {"e2": c["policies"]["e2"]}} for c in later])
