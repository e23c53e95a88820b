"""The summary statistics every benchmark reports, defined once.

Simulated (bench.sim) and measured (bench.swarm, bench.gossip, bench.router,
bench.ceiling) percentiles use the same definition, so their p50 and p99 compare like
for like: linear interpolation between order statistics (numpy's default, and
`statistics.quantiles(method="inclusive")`). Empty input gives nan, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean(xs: Sequence[float]) -> float:
    """The arithmetic mean; nan when empty."""
    return sum(xs) / len(xs) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by linear interpolation between order statistics."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def cov(xs: Sequence[float]) -> float:
    """Coefficient of variation (population standard deviation over the mean); 0 when
    the mean is 0, nan when empty."""
    if not xs:
        return math.nan
    m = sum(xs) / len(xs)
    if m == 0:
        return 0.0
    var = sum((x - m) ** 2 for x in xs) / len(xs)
    return math.sqrt(var) / m
