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


# Student's t 0.975 quantiles for 1..30 degrees of freedom (two-sided 95%); beyond, 1.96.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci95(xs: Sequence[float]) -> tuple[float, float]:
    """The mean and the half-width of its two-sided 95% confidence interval (Student's t
    on the sample standard deviation: independent seeds, roughly normal means). The
    half-width is nan with fewer than two values; (nan, nan) when empty."""
    vals = [x for x in xs if not math.isnan(x)]
    if not vals:
        return math.nan, math.nan
    m = sum(vals) / len(vals)
    n = len(vals)
    if n < 2:
        return m, math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in vals) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return m, t * sd / math.sqrt(n)
