"""The testbed's loads are measured: two pilots, each peer's line, the first peer to reach
the target names the rate."""

from __future__ import annotations

import pytest

from bench.testbed.loads import (
    PILOT_MAX_S,
    Pilot,
    first_pilot_rate,
    measured_rates,
    rate_for_target,
)


def test_the_first_peer_to_reach_the_target_names_the_rate() -> None:
    # peer 0: 0.2 + 0.02 r, peer 1: 0.1 + 0.01 r -> 0.9 at r = 35 and 80
    points = [(10.0, (0.4, 0.2)), (20.0, (0.6, 0.3))]
    assert rate_for_target(points, 0.9) == pytest.approx(35.0)
    assert rate_for_target(points, 0.5) == pytest.approx(15.0)


def test_a_flat_or_falling_peer_is_left_out_and_none_rising_is_an_error() -> None:
    assert rate_for_target([(10.0, (0.4, 0.5)), (20.0, (0.6, 0.4))], 0.9) == pytest.approx(35.0)
    with pytest.raises(ValueError, match="grew"):
        rate_for_target([(10.0, (0.4,)), (20.0, (0.4,))], 0.9)
    with pytest.raises(ValueError, match="two points"):
        rate_for_target([(10.0, (0.4,))], 0.9)


async def test_two_pilots_correct_a_bent_line() -> None:
    """Utilisation bends (per-request CPU falls as the rate grows): the idle point and the
    first pilot over-predict the busy rate's utilisation; the second pilot's line is read
    for both loads, and the pilots run on the rates the method chose."""
    backgrounds = (0.2, 0.1)

    def utilization(rate: float) -> tuple[float, ...]:
        return (0.2 + 0.03 * rate - 0.0002 * rate * rate, 0.1 + 0.01 * rate)

    asked: list[float] = []

    async def pilot(rate: float) -> Pilot:
        asked.append(rate)
        return Pilot(rate, utilization(rate))

    rates, pilots = await measured_rates({"half": 0.5, "high": 0.95}, 10.0, backgrounds, pilot)
    assert asked[0] == 10.0 and len(asked) == 2 == len(pilots)
    # from (0, 0.2) and (10, 0.48): 0.028 per request/s -> 0.95 at 26.8
    assert asked[1] == pytest.approx(10 + (0.95 - 0.48) / 0.028)
    # the second line is closer to the truth than the first at the high load
    first_guess_error = abs(utilization(asked[1])[0] - 0.95)
    assert abs(utilization(rates["high"])[0] - 0.95) < first_guess_error
    assert utilization(rates["half"])[0] == pytest.approx(0.5, abs=0.02)


async def test_an_idle_swarm_already_past_the_target_is_an_error() -> None:
    async def pilot(rate: float) -> Pilot:
        return Pilot(rate, (0.97 + 0.001 * rate,))

    with pytest.raises(ValueError, match="already"):
        await measured_rates({"high": 0.95}, 5.0, (0.96,), pilot)


def test_the_first_pilot_never_lasts_longer_than_its_bound() -> None:
    assert first_pilot_rate(22.0, 280) == 22.0
    assert first_pilot_rate(0.5, 280) == pytest.approx(280 / PILOT_MAX_S)


def test_a_target_below_a_pilot_is_read_between_the_points_around_it() -> None:
    """A larger model's pilots (peer 0: idle 0.2, 0.66 at 4.67/s, 0.79 at 7.14/s): the
    curve bends, so the half load lies between idle and the first pilot (~3.0/s), not on
    the line through the two pilots (1.4/s); the high load extends the last segment."""
    curve = [(0.0, (0.2, 0.05)), (4.67, (0.66, 0.35)), (7.14, (0.79, 0.53))]
    assert rate_for_target(curve, 0.5) == pytest.approx(4.67 * 0.3 / 0.46)
    assert rate_for_target(curve, 0.95) == pytest.approx(7.14 + 0.16 / (0.13 / 2.47))
    assert rate_for_target(list(reversed(curve)), 0.5) == rate_for_target(curve, 0.5)
