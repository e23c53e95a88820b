"""The testbed's loads: arrival rates at which the swarm that does not route (`local`: every
entry serves its own clients) has its busiest peer at a target utilisation, measured.

The simulator's rate (predict.rate_for_utilization) is where the search starts; two
short `local` pilot runs on a workload seed of their own then measure each peer's
utilisation, and each peer's line through the two points (utilisation grows about
linearly with the rate below saturation: a request's CPU is about the same at any rate)
gives the rate at which it reaches the target; the lowest over the peers is the load's.
Measured rather than predicted because the high load has to be met, not estimated: with
the simulator's rate alone only 5 of 75 high-load runs of a full run reached 0.9.
"""

from __future__ import annotations

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


def first_pilot_rate(simulated_rate: float, requests: int) -> float:
    """The simulator's rate for the lowest load, raised so the pilot lasts PILOT_MAX_S."""
    return max(simulated_rate, requests / PILOT_MAX_S)


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
    """The rate at which the first peer to get there reaches `target` utilisation, on each
    peer's line through the two last (rate, per-peer utilisations) points. A peer whose
    line does not rise is left out; ValueError when no peer's does. The rate may be <= 0
    where a peer is that busy idle."""
    if len(points) < 2:
        raise ValueError("two points are needed (a background at rate 0 counts as one)")
    (r0, u0), (r1, u1) = points[-2], points[-1]
    if len(u0) != len(u1):
        raise ValueError("the points give different numbers of peers")
    rates = []
    for a, b in zip(u0, u1, strict=True):
        slope = (b - a) / (r1 - r0) if r1 != r0 else 0.0
        if slope > MIN_SLOPE:
            rates.append(r1 + (target - b) / slope)
    if not rates:
        raise ValueError("no peer's utilisation grew with the rate")
    return min(rates)


RunPilot = Callable[[float], Awaitable[Pilot]]


async def measured_rates(targets: Mapping[str, float], first_rate: float,
                         backgrounds: Sequence[float], run_pilot: RunPilot,
                         ) -> tuple[dict[str, float], list[Pilot]]:
    """Rates per load name for the `targets` utilisations. A pilot at `first_rate` (well
    below saturation: about the lowest load's rate) with the idle peers (`backgrounds`,
    utilisation at rate 0) gives a first line; a second pilot at the highest target's
    rate from it gives the line every load is read from."""
    first = await run_pilot(first_rate)
    top = max(targets.values())
    second_rate = rate_for_target([(0.0, backgrounds), (first_rate, first.peer_utilization)],
                                  top)
    if second_rate <= 0:
        raise ValueError(f"the idle swarm is already {top} busy")
    second = await run_pilot(second_rate)
    line = [(first.rate_per_s, first.peer_utilization),
            (second.rate_per_s, second.peer_utilization)]
    rates = {name: rate_for_target(line, t) for name, t in targets.items()}
    for name, rate in rates.items():
        if rate <= 0:
            raise ValueError(f"load {name}: the idle swarm is already {targets[name]} busy")
    return rates, [first, second]
