"""Load probing: whether to ask the top candidates for their load now, whom, how long to wait.

A summary's load is up to an interval old, and entry peers that read the same stale
figures pile onto the same favourite; a probe costs round trips before the request
leaves, so ``plan_probes`` probes only where it can pay, ``ProbeRound`` collects answers
until a deadline, and ``fresh_estimate`` applies one with a summary's trust rules. The
live pipeline and the simulator's ``cost_probe`` both drive it; docs/protocol.md
(section 7.2, load probes) has the rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from peer.config import (
    DEFAULT_LOAD_PROBE_WAIT_S,
    DEFAULT_LOAD_PROBES,
    MAX_LOAD_PROBES,
    Policy,
)
from peer.routing.cost import STREAM_SETUP_ROUND_TRIPS, Candidate, PeerEstimate
from protocols.load import LoadReport

__all__ = [
    "DEFAULT_COST_FRACTION",
    "DEFAULT_MARGIN_FRACTION",
    "DEFAULT_MAX_PROBES",
    "DEFAULT_MAX_WAIT_S",
    "DEFAULT_MIN_WAIT_S",
    "MAX_PROBES",
    "PROBE_DEADLINE_RTTS",
    "PROBE_ROUND_TRIPS",
    "ProbePlan",
    "ProbeRound",
    "ProbeSettings",
    "ProbeWaits",
    "fresh_estimate",
    "plan_probes",
]

# Bounds and defaults, each with its reason.
PROBE_ROUND_TRIPS = STREAM_SETUP_ROUND_TRIPS + 1  # the stream's negotiation, then the query
PROBE_DEADLINE_RTTS = 4.0  # wait twice a probe's expected round trips: jitter, a busy loop
MAX_PROBES = MAX_LOAD_PROBES  # reasons at the constants in peer/config.py
DEFAULT_MAX_PROBES = DEFAULT_LOAD_PROBES
DEFAULT_MAX_WAIT_S = DEFAULT_LOAD_PROBE_WAIT_S
DEFAULT_MIN_WAIT_S = 0.02  # loopback round trips are ~4 ms but 20+ ms on a loaded 2-core box
# A probe may cost at most this fraction of the request's estimated completion time: the
# wait is paid by every request that probes, the saving only by those whose choice it
# changes, so a probe that costs as much as the differences it could find (a GPU peer
# at a few ms of delay: ~20 ms of probe against ~90 ms of request) loses on average. 5%
# is the margin within which the router is held to the best other policy;
# docs/cost-model.md has the sweep behind it.
DEFAULT_COST_FRACTION = 0.05
# What a probe costs is learned from the entry's own rounds (ProbeWaits): each round's share
# of the moving mean (a plain mean of the first ones, as ForwardOverhead's), and how much
# each request routed without a probe shrinks it, so that a mean measured while the
# answering peers were starved of CPU cannot stop probing for good (halved in ~70).
PROBE_WAIT_WEIGHT = 0.1
PROBE_WAIT_FORGET = 0.01
PROBE_WAIT_BOUND_S = DEFAULT_LOAD_PROBE_WAIT_S  # one round counts at most the default wait
# How far off the best's cost its gossiped load may be (a close call below it): a
# judgement, not a fit; 0.5 and 2.0 gave the same TTFT within noise in the simulator at
# load 1.5 (docs/cost-model.md).
DEFAULT_MARGIN_FRACTION = 0.5


@dataclass(frozen=True)
class ProbeSettings:
    """How much probing an entry peer allows itself (validated once)."""

    max_probes: int = DEFAULT_MAX_PROBES  # k; 0 turns probing off
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    min_wait_s: float = DEFAULT_MIN_WAIT_S
    margin_fraction: float = DEFAULT_MARGIN_FRACTION
    cost_fraction: float = DEFAULT_COST_FRACTION  # probe round trips / best's cost; inf: any

    def __post_init__(self) -> None:
        if type(self.max_probes) is not int or not 0 <= self.max_probes <= MAX_PROBES:
            raise ValueError(
                f"max_probes must be an int in [0, {MAX_PROBES}], got {self.max_probes!r}"
            )
        for name in ("max_wait_s", "min_wait_s", "margin_fraction"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        budget = self.cost_fraction
        if not (isinstance(budget, int | float) and budget >= 0):  # math.inf: no budget
            raise ValueError(f"cost_fraction must be a number >= 0, got {budget!r}")
        if self.min_wait_s > self.max_wait_s:
            raise ValueError("min_wait_s must be <= max_wait_s")


class ProbePlan(NamedTuple):
    """Whom to ask (best first) and how long to wait for their answers, at most."""

    peers: tuple[str, ...]
    wait_s: float  # 0.0 when ``peers`` is empty
    gains_s: tuple[float, ...]  # per probed peer: the most its answer could save
    rtt_s: float = 0.0  # the slowest probed peer's estimated round trip

    @property
    def probes(self) -> bool:
        return bool(self.peers)


NO_PROBE = ProbePlan((), 0.0, ())


def plan_probes(ranked: Sequence[Candidate], settings: ProbeSettings,
                late_s: float = 0.0) -> ProbePlan:
    """The probes worth their cost for this ranking: remote candidates whose fresh load
    could change the choice by more than the probe costs, at most ``max_probes``, none
    when the probe is dearer than ``cost_fraction`` of the best's cost. A probe costs its
    round trips and what this entry's rounds were seen to wait beyond theirs
    (``late_s``, ProbeWaits.late_s): an answer that comes late (a peer out of CPU) or
    never holds the request to the round's deadline."""
    if settings.max_probes == 0 or len(ranked) < 2 or ranked[0].policy is not Policy.COST:
        return NO_PROBE
    best = ranked[0]
    top = best.cost_s
    others = [c.cost_s for c in ranked[1:] if c.estimate.failed_s_ago is None]
    runner_up = min(others, default=math.inf)
    worth: list[tuple[float, int, Candidate]] = []
    for index, c in enumerate(ranked):
        e = c.estimate
        if c.is_local or e.failed_s_ago is not None:
            continue  # the entry peer's load is exact; a suspect ranks after it anyway
        if index == 0:
            gain = settings.margin_fraction * top - (runner_up - top)
        else:
            gain = top - (c.cost_s - c.queue_s)
        if gain > PROBE_ROUND_TRIPS * e.rtt_s + late_s:
            worth.append((gain, index, c))
    if not worth:
        return NO_PROBE
    worth.sort(key=lambda item: (-item[0], item[1]))
    chosen = sorted(worth[: settings.max_probes], key=lambda item: item[1])
    rtt = max(c.estimate.rtt_s for _, _, c in chosen)
    if PROBE_ROUND_TRIPS * rtt + late_s > settings.cost_fraction * top:
        return NO_PROBE  # the probe alone would cost more than it is worth on average
    most = max(gain for gain, _, _ in chosen)
    wait = min(settings.max_wait_s, most, max(settings.min_wait_s, PROBE_DEADLINE_RTTS * rtt))
    return ProbePlan(
        tuple(c.peer_id for _, _, c in chosen), wait, tuple(gain for gain, _, _ in chosen), rtt
    )


class ProbeRound:
    """Answers to one plan, accepted until ``deadline`` (a time, as the caller's clock):
    ``plan.wait_s`` after ``started_at``, and not after ``not_after`` (the request's own
    deadline)."""

    def __init__(self, plan: ProbePlan, started_at: float, not_after: float = math.inf) -> None:
        self.plan = plan
        self.deadline = min(started_at + plan.wait_s, not_after)
        self._asked = frozenset(plan.peers)
        self.reports: dict[str, LoadReport] = {}
        self.late = 0
        self.unasked = 0

    def offer(self, peer_id: str, report: LoadReport, now: float) -> bool:
        """Keep ``report`` if ``peer_id`` was asked, has not answered yet, and the deadline
        has not passed; returns whether it was kept."""
        if peer_id not in self._asked or peer_id in self.reports:
            self.unasked += 1
            return False
        if now > self.deadline:
            self.late += 1
            return False
        self.reports[peer_id] = report
        return True

    @property
    def done(self) -> bool:
        """Every peer asked has answered: no reason to wait for the deadline."""
        return len(self.reports) == len(self._asked)


class ProbeWaits:
    """A moving mean of how long this entry's probe rounds held their requests beyond
    their round trips, from a round's start to its decision (pure; it moves with
    requests, not with a clock).

    plan_probes prices a probe at its round trips, which is what it costs where peers
    answer at once. A peer held to a small CPU quota answers only when its quota lets it
    run, and on a testbed of such peers many rounds waited out their whole deadline:
    every request that probed paid it, and few choices changed. The router keeps one
    (Router.probe_waits); the live pipeline and the simulator feed it alike."""

    __slots__ = ("_mean", "_seen", "weight")

    def __init__(self, weight: float = PROBE_WAIT_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._mean = 0.0
        self._seen = 0

    def waited(self, seconds: float, rtt_s: float) -> None:
        """A probe round held its request ``seconds``; its slowest probed peer was
        estimated ``rtt_s`` away (PROBE_ROUND_TRIPS of those are the model's part)."""
        for name, value in (("seconds", seconds), ("rtt_s", rtt_s)):
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {value}")
        late = min(max(0.0, seconds - PROBE_ROUND_TRIPS * rtt_s), PROBE_WAIT_BOUND_S)
        self._seen += 1
        w = max(self.weight, 1.0 / self._seen)  # a plain mean of the first ones
        self._mean += w * (late - self._mean)

    def not_probed(self) -> None:
        """A request was routed without a probe round (PROBE_WAIT_FORGET)."""
        self._mean -= PROBE_WAIT_FORGET * self._mean

    @property
    def late_s(self) -> float:
        """Seconds a probe round is expected to wait beyond its round trips (0 before
        any)."""
        return self._mean

    def statistics(self) -> dict[str, float]:
        return {"probe_late_mean_s": round(self._mean, 4), "probe_rounds_seen": self._seen}


def fresh_estimate(
    estimate: PeerEstimate, report: LoadReport, own_forwards: int, own_tokens: int
) -> PeerEstimate:
    """``estimate`` with the load of ``report``, floored by this entry peer's own forwards
    there still counted in its table (``own_forwards`` requests, ``own_tokens`` of their
    prompts not yet prefilled there)."""
    if own_forwards < 0 or own_tokens < 0:
        raise ValueError("own_forwards and own_tokens must be >= 0")
    return estimate._replace(
        queued_prompt_tokens=max(report.queued_prompt_tokens, own_tokens),
        running_requests=max(report.running_requests, own_forwards),
    )
