"""The testbed's loads: arrival rates at which the swarm that does not route (`local`: every
entry serves its own clients) has its busiest peer at a target utilisation, measured.

The simulator's rate (predict.rate_for_utilization) is where the search starts; two
short `local` pilot runs on a workload seed of their own then measure each peer's
utilisation, and each peer's curve through its idle point and the two pilots (read
piecewise linearly: utilisation grows with the rate, less than linearly where batching
makes a request cheaper) gives the rate at which it reaches the target; the lowest over
the peers is the load's.
Measured rather than predicted because the high load has to be met, not estimated: with
the simulator's rate alone only 5 of 75 high-load runs of a full run reached 0.9.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

# The seed of the pilots' workloads is the run seed plus this: never a measured run's.
PILOT_SEED_OFFSET = 1000
# Below this the fitted line is too flat to extrapolate (a peer the pilot barely used).
MIN_SLOPE = 1e-6
# The first pilot's requests arrive within this at the least: any rate below saturation
# gives a point of the line, and a simulator whose calibration overcharges (one put a
# larger model's busiest peer at 0.79 busy at 0.5 requests/s) must not make it last minutes.
PILOT_MAX_S = 60.0
QUICK_PILOT_MAX_S = 40.0  # quick: 3 requests/s, light even on a slow machine under load


def first_pilot_rate(simulated_rate: float, requests: int, max_s: float = PILOT_MAX_S) -> float:
    """The simulator's rate for the lowest load, raised so the pilot lasts at most `max_s`
    (PILOT_MAX_S; `--quick`, QUICK_PILOT_MAX_S)."""
    return max(simulated_rate, requests / max_s)


@dataclass(frozen=True)
class Pilot:
    """One pilot run: its arrival rate and each peer's measured utilisation."""

    rate_per_s: float
    peer_utilization: tuple[float, ...]
    ttft_mean_s: float = math.nan

    def as_dict(self) -> dict[str, object]:
        return {"rate_per_s": round(self.rate_per_s, 3),
                "peer_utilization": [round(u, 4) for u in self.peer_utilization],
                "ttft_mean_s": self.ttft_mean_s}


def rate_for_target(points: Sequence[tuple[float, Sequence[float]]], target: float) -> float:
    """The rate at which the first peer to get there reaches `target` utilisation. Each
    peer's utilisation is read piecewise linearly between the (rate, per-peer
    utilisations) points, in rate order, and extrapolated along the last rising segment
    beyond them: with batching a request costs less CPU as the rate grows, so the curve
    bends, and a target below a measured point is read between the points around it, not
    on a line through two busier ones. A peer that never rises is left out; ValueError
    when none does. The rate may be <= 0 where a peer is that busy idle."""
    if len(points) < 2:
        raise ValueError("two points are needed (a background at rate 0 counts as one)")
    ordered = sorted(points, key=lambda p: p[0])
    peers = {len(u) for _, u in ordered}
    if len(peers) != 1:
        raise ValueError("the points give different numbers of peers")
    rates = [rate for peer in range(peers.pop())
             if (rate := _peer_rate([(r, u[peer]) for r, u in ordered], target)) is not None]
    if not rates:
        raise ValueError("no peer's utilisation grew with the rate")
    return min(rates)


def _peer_rate(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """Where one peer's piecewise-linear curve reaches `target` (None: it never rises)."""
    last: tuple[float, float, float] | None = None  # (rate, utilisation, slope)
    for (r0, u0), (r1, u1) in itertools.pairwise(curve):
        slope = (u1 - u0) / (r1 - r0) if r1 != r0 else 0.0
        if slope <= MIN_SLOPE:
            continue
        if u0 >= target and last is None:
            return r0 + (target - u0) / slope  # already past it at the first point
        if u0 <= target <= u1:
            return r0 + (target - u0) / slope
        last = (r1, u1, slope)
    if last is None:
        return None
    r, u, slope = last
    return r + (target - u) / slope


RunPilot = Callable[[float], Awaitable[Pilot]]


async def measured_rates(targets: Mapping[str, float], first_rate: float,
                         backgrounds: Sequence[float], run_pilot: RunPilot,
                         ) -> tuple[dict[str, float], list[Pilot]]:
    """Rates per load name for the `targets` utilisations. A pilot at `first_rate` (well
    below saturation: about the lowest load's rate) with the idle peers (`backgrounds`,
    utilisation at rate 0) gives a first line; a second pilot at the highest target's
    rate on it; every load is read on the curve through all three points."""
    curve: list[tuple[float, Sequence[float]]] = [(0.0, backgrounds)]

    def rate_on_curve(target: float) -> float:
        rate = rate_for_target(curve, target)
        if rate <= 0:
            raise ValueError(f"the idle swarm is already {target} busy")
        return rate

    first = await run_pilot(first_rate)
    curve.append((first.rate_per_s, first.peer_utilization))
    second = await run_pilot(rate_on_curve(max(targets.values())))
    curve.append((second.rate_per_s, second.peer_utilization))
    return {name: rate_on_curve(t) for name, t in targets.items()}, [first, second]
