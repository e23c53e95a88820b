"""The CPU a peer's requests take in a running swarm, against what the simulator charges
on its calibration measured alone: the factor the load pilots give, and the simulator
charging it."""

from __future__ import annotations

from dataclasses import replace

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


@pytest.mark.parametrize("off_path", [True, False])
def test_the_simulator_charges_the_factor_and_the_pilots_give_it_back(off_path: bool) -> None:
    cal = Calibration("flat", 0.001, 1e-4, 0.0, 0.005, "test", batch_step_slope=1.0)
    alone = SimSetup((cal, cal), capacity_blocks=256, summary_interval_s=0.5,
                     factors_off_path=off_path)
    slower = replace(alone, cpu_factors=(2.0, 1.0))
    params = slower.params("local", 0.0, seed=1)
    # on the path every cost is scaled; off it the costs stay and the extra follows a step
    assert params.peer_calibrations[0].prefill_s_per_token == pytest.approx(
        1e-4 if off_path else 2e-4)
    assert params.peer_calibrations[0].after_step_fraction == (1.0 if off_path else 0.0)
    assert params.peer_calibrations[1].prefill_s_per_token == pytest.approx(1e-4)
    assert params.peer_calibrations[1].after_step_fraction == 0.0
    base = predict(alone, "local", 0.0, _requests(20.0), seed=1).peer_utilization
    doubled = predict(slower, "local", 0.0, _requests(20.0), seed=1).peer_utilization
    assert doubled[0] == pytest.approx(2 * base[0], rel=0.05)
    assert doubled[1] == pytest.approx(base[1], rel=0.05)
    # pilots measured on the slower swarm give its factors back to the setup measured alone
    pilots = [(rate, predict(slower, "local", 0.0, _requests(rate), 7).peer_utilization)
              for rate in (10.0, 20.0)]
    got = with_pilot_factors(alone, pilots, [0.0, 0.0], _requests, "local", 0.0, 7)
    assert got.cpu_factors == pytest.approx((2.0, 1.0), rel=0.05)


def test_the_factors_are_charged_off_the_path_by_default() -> None:
    cal = Calibration("flat", 0.001, 1e-4, 0.0, 0.005, "test", batch_step_slope=1.0)
    setup = SimSetup((cal,), capacity_blocks=256, summary_interval_s=0.5, cpu_factors=(1.5,))
    assert setup.params("local", 0.0, seed=1).peer_calibrations[0].after_step_fraction == 0.5
