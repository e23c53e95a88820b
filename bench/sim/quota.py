"""A peer held to a CPU quota, as a CFS bandwidth limit holds it: full speed while the
current period's budget lasts, then nothing until the next period.

A cgroup quota of q cores (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, or `cpu.max`) gives
its processes q x period of CPU time per period, at a whole core's speed. A short request
that finds budget left runs at full speed; one that does not waits for the next period.
A fluid server at q cores (every second of work taking 1/q seconds) gets the mean right
and the timing wrong at both ends: too slow when the peer is mostly idle, too smooth when
it is saturated. `CpuQuota.run` walks a piece of work through the periods;
`CpuQuota.runnable_at` says when the peer's other threads can next run at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_PERIOD_S = 0.1  # the kernel's default cfs period (the testbed's: --cfs-period-ms)
KEPT_PERIODS = 64  # periods whose exhaustion is remembered (work is never planned further)
_EPS = 1e-12


@dataclass
class CpuQuota:
    """`share` cores per `period_s`, at one core's speed; state: this period's use."""

    share: float
    period_s: float = DEFAULT_PERIOD_S
    _period: int = field(default=-1, repr=False)
    _used_s: float = field(default=0.0, repr=False)
    # when each recent period's budget ran out (by period number): the peer is throttled
    # from then to the period's end, whatever thread wants to run
    _exhausted: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be in (0, 1] of a core, got {self.share}")
        if self.period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {self.period_s}")

    def run(self, start: float, cpu_s: float) -> float:
        """When `cpu_s` seconds of one core's work that start at `start` end (work runs
        one piece after another: `start` is never before the previous piece's end)."""
        t, left = start, max(0.0, cpu_s)
        budget = self.share * self.period_s
        while left > _EPS:
            k = math.floor(t / self.period_s)
            boundary = (k + 1) * self.period_s
            if boundary <= t:  # t sits on a boundary that floor() rounded below
                k += 1
                boundary = (k + 1) * self.period_s
            if k != self._period:
                self._period, self._used_s = k, 0.0
            room = budget - self._used_s
            if room <= _EPS:
                t = boundary
                continue
            ran = min(left, room, boundary - t)
            t += ran
            left -= ran
            self._used_s += ran
            if budget - self._used_s <= _EPS:
                self._exhausted[k] = t
                self._exhausted.pop(k - KEPT_PERIODS, None)
        return t

    def runnable_at(self, t: float) -> float:
        """The first moment from `t` at which the peer is not throttled: a piece of work
        on another thread than the steps' (relaying a forward's first token, sending a
        forward) waits out a period whose budget ran out before it, and takes no budget
        itself here (its CPU is charged with the peer's other overheads)."""
        k = math.floor(t / self.period_s)
        while k in self._exhausted and t >= self._exhausted[k]:
            k += 1
            t = max(t, k * self.period_s)
        return t
