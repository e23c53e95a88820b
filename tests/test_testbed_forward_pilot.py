"""The CPU a forward takes its entry in a running swarm beyond what the simulator charges:
the residual the forward pilot gives, the simulator charging it, and the variants that
charge the measured extra CPU off a request's path."""

from __future__ import annotations

import pytest

from bench.sim.calibration import Calibration
from bench.testbed.predict import (
    FORWARD_CPU_MAX_S,
    ForwardSample,
    SimSetup,
    forward_cpu,
    forwards_per_entry,
    measured_window,
    predict,
    with_forward_pilot,
)
from bench.workloads import TokenRequest

CAL = Calibration("flat", 0.001, 1e-4, 0.0, 0.005, "test", batch_step_slope=1.0,
                  forward_overhead_s=0.001)


def _requests(rate: float, n: int = 60) -> list[TokenRequest]:
    return [TokenRequest(i / rate, i, tuple(range(i * 1000, i * 1000 + 200)), (), 1)
            for i in range(n)]


def test_the_residual_is_the_cpu_past_the_simulation_over_the_forwards() -> None:
    # peer 0 (half a core): 0.1 of it more than simulated over 10 s and 20 s, 0.5 + 1.0
    # CPU seconds; peer 1 (a core) 0.02 less, 0.2 + 0.4; over 30 + 10 forwards
    samples = [ForwardSample([0.6, 0.28], [0.5, 0.3], [10, 5], 10.0),
               ForwardSample([0.6, 0.28], [0.5, 0.3], [20, 5], 20.0)]
    assert forward_cpu(samples, [0.5, 1.0], 40) == pytest.approx((1.5 - 0.6) / 40)
    assert forward_cpu(samples, [0.5, 1.0], 41) == 0.0  # too few forwards to tell
    assert forward_cpu(samples, [0.5, 1.0]) == 0.0  # FORWARD_MIN_FORWARDS
    assert forward_cpu([ForwardSample([0.9], [0.1], [0], 10.0)], [1.0], 0) == 0.0
    assert forward_cpu([ForwardSample([0.9], [0.1], [1], 10.0)], [1.0], 1) == FORWARD_CPU_MAX_S
    assert forward_cpu([ForwardSample([0.9], [0.1], [1], -10.0)], [1.0],
                       1) == -FORWARD_CPU_MAX_S
    assert forward_cpu([ForwardSample([0.4], [0.5], [100], 10.0)], [1.0],
                       100) == pytest.approx(-0.01)


def test_forwards_and_the_measured_window() -> None:
    assert forwards_per_entry([[3, 1, 2], [0, 4, 0], [5, 5, 5]]) == [3, 0, 10]
    requests = _requests(10.0, n=5)  # arrivals 0, 0.1, ..., 0.4
    assert measured_window(requests, 2) == pytest.approx(0.2)
    assert measured_window(requests, 5) == 0.0


def test_the_simulator_charges_the_residual_and_the_pilot_gives_it_back() -> None:
    plain = SimSetup((CAL, CAL), capacity_blocks=256, summary_interval_s=0.5)
    truth = SimSetup((CAL, CAL), capacity_blocks=256, summary_interval_s=0.5,
                     forward_cpu_s=0.004)
    params = truth.params("random", 0.0, seed=1)
    cheaper = SimSetup((CAL,), capacity_blocks=256, summary_interval_s=0.5,
                       forward_cpu_s=-0.01).params("random", 0.0, seed=1)
    assert cheaper.peer_calibrations[0].forward_overhead_s == 0.0  # down to none
    assert params.peer_calibrations[0].forward_overhead_s == pytest.approx(0.005)
    assert params.peer_calibrations[1].forward_overhead_s == pytest.approx(0.005)
    assert params.peer_calibrations[0].prefill_s_per_token == CAL.prefill_s_per_token
    runs = []
    for seed in (3, 4):
        workload = _requests(20.0)
        measured = predict(truth, "random", 0.0, workload, seed)
        base = predict(plain, "random", 0.0, workload, seed)
        forwards = forwards_per_entry(measured.per_entry["served_matrix"])
        assert sum(forwards) > 0
        assert measured.peer_utilization[0] > base.peer_utilization[0]
        runs.append((measured.peer_utilization, forwards, workload, seed))
    assert with_forward_pilot(plain, runs, [1.0, 1.0], "random", 0.0).forward_cpu_s == 0.0
    got = with_forward_pilot(plain, runs, [1.0, 1.0], "random", 0.0, min_forwards=40)
    # the simulated "measurement" charged shadows too, which the pilot does not count
    assert got.forward_cpu_s == pytest.approx(0.004, rel=0.35)


def test_charged_off_the_path_the_extra_cpu_leaves_a_lone_request_as_fast() -> None:
    lone = [TokenRequest(0.0, 0, tuple(range(200)), (), 2)]
    plain = SimSetup((CAL,), capacity_blocks=256, summary_interval_s=0.5)
    on_path = SimSetup((CAL,), capacity_blocks=256, summary_interval_s=0.5,
                       cpu_factors=(2.0,), factors_off_path=False)
    off_path = SimSetup((CAL,), capacity_blocks=256, summary_interval_s=0.5,
                        cpu_factors=(2.0,), factors_off_path=True)
    assert off_path.params("local", 0.0, 1).peer_calibrations[0].after_step_fraction == 1.0
    base = predict(plain, "local", 0.0, lone, 1).ttft_mean_s
    assert predict(on_path, "local", 0.0, lone, 1).ttft_mean_s > 1.5 * base
    assert predict(off_path, "local", 0.0, lone, 1).ttft_mean_s == pytest.approx(base)
    # at load the extra work is there all the same: the peer is about twice as busy
    busy = [predict(s, "local", 0.0, _requests(20.0), 1).peer_utilization[0]
            for s in (plain, off_path)]
    assert busy[1] == pytest.approx(2 * busy[0], rel=0.1)


def test_a_residual_after_the_answer_is_off_the_forwards_path() -> None:
    setups = [SimSetup((CAL, CAL), capacity_blocks=256, summary_interval_s=0.5,
                       forward_cpu_s=0.05, forward_after_answer=after)
              for after in (False, True)]
    assert setups[1].params("random", 0.0, 1).peer_calibrations[0].forward_tail_s == 0.05
    workload = _requests(2.0, n=30)  # light: no request waits behind another's tail
    with_forward, after_answer = (predict(s, "random", 0.0, workload, 5) for s in setups)
    assert after_answer.ttft_mean_s < with_forward.ttft_mean_s
    assert after_answer.peer_utilization[0] == pytest.approx(
        with_forward.peer_utilization[0], rel=0.2)


def test_the_cpu_split_recovers_each_kind_of_requests_cost() -> None:
    import random

    from bench.testbed.cpu_split import split

    rng = random.Random(0)
    costs = (0.030, 0.020, 0.010)  # served own, served forwarded, forwarded at the entry
    rows = []
    for _ in range(12):
        matrix = [[rng.randrange(40) for _ in range(2)] for _ in range(2)]
        rate = rng.choice((5.0, 10.0))
        window = 100 / rate
        util = []
        for p in range(2):
            own, forwarded_in = matrix[p][p], matrix[1 - p][p]
            cpu = costs[0] * own + costs[1] * forwarded_in + costs[2] * matrix[p][1 - p]
            util.append(0.1 + cpu / (0.5 * window))
        rows.append({"rate_per_s": rate, "peer_utilization": util, "served_matrix": matrix,
                     "predicted_peer_utilization": [0.1, 0.1],
                     "predicted_served_matrix": matrix})
    got = split(rows, [0.5, 0.5], [0.1, 0.1], 100)
    for peer in got:
        assert [peer[k] for k in ("served_own_ms", "served_forwarded_ms",
                                  "forwarded_at_entry_ms")] == pytest.approx([30, 20, 10], abs=0.1)
    assert all(v == pytest.approx(0, abs=1e-6)
               for peer in split(rows, [0.5, 0.5], [0.1, 0.1], 100, "row")
               for v in peer.values())
