"""The CPU a peer's requests take in a running swarm, against what the simulator charges
on its calibration measured alone: the factor the load pilots give, and the simulator
charging it."""

from __future__ import annotations

import pytest

from bench.sim.calibration import Calibration
from bench.testbed.predict import (
    CPU_FACTOR_BOUNDS,
    SimSetup,
    cpu_factors,
    predict,
    with_pilot_factors,
)
from bench.workloads import TokenRequest


def test_the_factor_is_the_requests_cpu_measured_over_simulated_past_the_idle_self() -> None:
    # peer 0: 0.1 idle, requests 0.3 + 0.5 measured against 0.2 + 0.4 simulated: 8/6
    got = cpu_factors([[0.4, 0.3], [0.6, 0.3]], [[0.3, 0.1], [0.5, 0.1]], [0.1, 0.1])
    assert got[0] == pytest.approx(0.8 / 0.6)
    assert got[1] == 1.0  # nothing charged past the idle self: 1.0
    assert cpu_factors([[0.3]], [[0.1]], [0.1]) == (1.0,)
    assert cpu_factors([[0.99]], [[0.11]], [0.1]) == (CPU_FACTOR_BOUNDS[1],)
    assert cpu_factors([[0.11]], [[0.9]], [0.1]) == (CPU_FACTOR_BOUNDS[0],)
    with pytest.raises(ValueError):
        cpu_factors([[0.3]], [], [0.1])


def _requests(rate: float, n: int = 40) -> list[TokenRequest]:
    return [TokenRequest(i / rate, i, tuple(range(i * 1000, i * 1000 + 200)), (), 1)
            for i in range(n)]


def test_the_simulator_charges_the_factor_and_the_pilots_give_it_back() -> None:
    cal = Calibration("flat", 0.001, 1e-4, 0.0, 0.005, "test", batch_step_slope=1.0)
    alone = SimSetup((cal, cal), capacity_blocks=256, summary_interval_s=0.5)
    slower = SimSetup((cal, cal), capacity_blocks=256, summary_interval_s=0.5,
                      cpu_factors=(2.0, 1.0))
    params = slower.params("local", 0.0, seed=1)
    assert params.peer_calibrations[0].prefill_s_per_token == pytest.approx(2e-4)
    assert params.peer_calibrations[1].prefill_s_per_token == pytest.approx(1e-4)
    base = predict(alone, "local", 0.0, _requests(20.0), seed=1).peer_utilization
    doubled = predict(slower, "local", 0.0, _requests(20.0), seed=1).peer_utilization
    assert doubled[0] == pytest.approx(2 * base[0], rel=0.05)
    assert doubled[1] == pytest.approx(base[1], rel=0.05)
    # pilots measured on the slower swarm give its factors back to the setup measured alone
    pilots = [(rate, predict(slower, "local", 0.0, _requests(rate), 7).peer_utilization)
              for rate in (10.0, 20.0)]
    got = with_pilot_factors(alone, pilots, [0.0, 0.0], _requests, "local", 0.0, 7)
    assert got.cpu_factors == pytest.approx((2.0, 1.0), rel=0.05)
