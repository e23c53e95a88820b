"""bench.testbed.repredict: a committed run's predictions made again by today's simulator,
on the arrivals each run sent, with the forwards' residual from its pilot or its own rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.testbed.workload import WorkloadSpec, mixed_requests
from tests.helpers_testbed import mmlu_by_chars as _data


def test_predictions_made_again_replay_the_runs_own_arrivals() -> None:
    """`repredict` gives each row the prediction of the workload its run sent: at a load
    whose warm-up was paced, the paced arrivals (as the run's own prediction had them),
    not the mix as drawn; a run from before pacing (no `warmup_pace`) is unpaced."""
    from bench.sim.calibration import Calibration
    from bench.testbed.predict import predict, setup_from_result
    from bench.testbed.repredict import repredict
    from bench.testbed.workload import run_workload

    cal = Calibration("p", 0.004, 2e-5, 0.0, 0.002, "test")
    params = {"shares": [0.5, 0.5], "isolated": False, "capacity_blocks": 64,
              "summary_interval_s": 1.0, "warmup_requests": 30, "requests": 30,
              "max_new_tokens": 2, "warmup_pace": {"half": 1.9, "high": 1.0},
              "warmup_pause_s": 0.5}
    rows = [{"policy": "local", "delay_ms": 0.0, "load": load, "rate_per_s": rate,
             "seed": 4, "run": 0, "ttft_mean_s": 0.1, "hit_ratio": 0.5,
             "forwarded_fraction": 0.0, "busiest_peer_utilization": 0.5}
            for load, rate in (("half", 30.0), ("high", 60.0))]
    result = {"params": params, "rows": rows,
              "calibration": [{"calibration": cal.as_dict(), "background_cores": 0.0}] * 2}
    data = _data()
    repredict(result, data)
    setup = setup_from_result(result)
    for row in rows:
        spec = WorkloadSpec(60, row["rate_per_s"], 2, 4)
        pace = params["warmup_pace"][row["load"]]
        sent = predict(setup, "local", 0.0, run_workload(data, spec, 30, pace, 0.5), 4)
        assert row["predicted_ttft_mean_s"] == sent.ttft_mean_s
        assert row["predicted_at_run"]["predicted_ttft_mean_s"] is None  # none before
    half = rows[0]
    unpaced = predict(setup, "local", 0.0, mixed_requests(data, WorkloadSpec(60, 30.0, 2, 4)), 4)
    assert half["predicted_ttft_mean_s"] != unpaced.ttft_mean_s
    del params["warmup_pace"]  # a run from before the paced warm-up
    repredict(result, data)
    assert half["predicted_ttft_mean_s"] == unpaced.ttft_mean_s


def test_a_committed_run_is_predicted_again_by_todays_simulator(tmp_path: Path) -> None:
    """repredict: the measurements stand, each row's predictions are made again from the
    run's calibration and the row's workload, the run's own kept beside them."""
    from bench.sim.calibration import Calibration
    from bench.testbed.repredict import main as repredict_main

    cal = Calibration("p", 0.02, 1e-5, 0.0, 0.005, "test", request_overhead_s=0.01,
                      forward_overhead_s=0.01)
    result = {
        "params": {"shares": [0.5, 0.5], "isolated": True, "capacity_blocks": 256,
                   "summary_interval_s": 1.0, "warmup_requests": 10, "requests": 30,
                   "max_new_tokens": 2},
        "calibration": [{"background_cores": 0.05, "calibration": cal.as_dict()}] * 2,
        "rows": [{"policy": "local", "delay_ms": 20.0, "load": "half", "rate_per_s": 4.0,
                  "run": 0, "seed": 7, "ttft_mean_s": 0.05, "predicted_ttft_mean_s": 9.0,
                  "predicted_busiest_peer_utilization": 9.0, "predicted_hit_ratio": 9.0}],
    }
    path = tmp_path / "testbed.json"
    path.write_text(json.dumps(result))
    repredict_main(["--json", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["predicted_at_run"]["predicted_ttft_mean_s"] == 9.0
    assert 0 < row["predicted_ttft_mean_s"] < 1.0
    assert 0.1 <= row["predicted_busiest_peer_utilization"] <= 1.0  # 0.05 / 0.5 idle at least
    # per peer: `local` serves each request where it entered; the busiest is one of them
    assert sum(row["predicted_served_per_peer"]) == 30
    assert max(row["predicted_peer_utilization"]) == pytest.approx(
        row["predicted_busiest_peer_utilization"], abs=1e-4)
    assert row["predicted_at_run"]["predicted_served_per_peer"] is None  # not predicted then
    # per entry: `local` serves each request where it entered
    matrix = row["predicted_served_matrix"]
    assert [matrix[i][i] for i in range(2)] == row["predicted_served_per_peer"]
    assert row["predicted_forwarded_fraction_per_entry"] == [0.0, 0.0]
    again = json.loads(path.read_text())
    assert again["params"]["repredicted"]["cpu_quotas"] == [0.45, 0.45]
    repredict_main(["--json", str(path)])  # twice: the run's own predictions stay
    (row2,) = json.loads(path.read_text())["rows"]
    assert row2["predicted_at_run"]["predicted_ttft_mean_s"] == 9.0
    assert row2["predicted_ttft_mean_s"] == row["predicted_ttft_mean_s"]


def test_predictions_made_again_charge_the_forwards_residual() -> None:
    """repredict on a run from before the forward pilot takes the residual from its own
    `random` rows at the first delay and the half load; on a run with a pilot, from the
    pilot's record."""
    from bench.sim.calibration import Calibration
    from bench.testbed.predict import forwards_per_entry, predict, setup_from_result
    from bench.testbed.repredict import with_forwards
    from bench.testbed.workload import run_workload

    cal = Calibration("p", 0.004, 2e-5, 0.0, 0.002, "test", forward_overhead_s=0.002)
    params = {"shares": [0.5, 0.5], "isolated": False, "capacity_blocks": 64,
              "summary_interval_s": 1.0, "warmup_requests": 20, "requests": 200,
              "max_new_tokens": 2, "delays_ms": [0.0, 20.0], "loads": {"half": 0.5},
              "warmup_pace": {"half": 1.0}, "warmup_pause_s": 0.0}
    result: dict = {"params": params, "rows": [],
                    "calibration": [{"calibration": cal.as_dict(), "background_cores": 0.0}] * 2}
    data = _data()
    truth = dataclasses.replace(setup_from_result(result), forward_cpu_s=0.01)
    runs = []
    for seed in range(3):
        workload = run_workload(data, WorkloadSpec(220, 8.0, 2, seed), 20, 1.0, 0.0)
        pred = predict(truth, "random", 0.0, workload, seed)
        matrix = pred.per_entry["served_matrix"]
        runs.append({"seed": seed, "peer_utilization": list(pred.peer_utilization),
                     "forwards_per_entry": forwards_per_entry(matrix)})
        result["rows"].append({"policy": "random", "delay_ms": 0.0, "load": "half",
                               "rate_per_s": 8.0, "seed": seed, "served_matrix": matrix,
                               "peer_utilization": list(pred.peer_utilization)})
    setup, source = with_forwards(result, setup_from_result(result), data)
    assert source == "rows: random, d = 0 ms, half, 3 runs"
    assert setup.forward_cpu_s == pytest.approx(0.01, rel=0.35)  # shadows are charged too
    result["forward_pilot"] = {"policy": "random", "delay_ms": 0.0, "rate_per_s": 8.0,
                               "runs": runs}
    again, source = with_forwards(result, setup_from_result(result), data)
    assert source == "the forward pilot, 3 runs"
    assert again.forward_cpu_s == pytest.approx(setup.forward_cpu_s)
    for row in result["rows"]:
        row["delay_ms"] = 20.0  # none at the first delay: nothing to take it from
    del result["forward_pilot"]
    assert with_forwards(result, setup_from_result(result), data)[1] == ""
