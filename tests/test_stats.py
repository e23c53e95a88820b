"""bench.stats: one percentile definition for simulated and measured results."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.stats import cov, mean, percentile


@given(st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=50))
def test_percentiles_are_the_inclusive_quantiles(xs: list[float]) -> None:
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    for k in (1, 10, 50, 90, 99):
        assert percentile(xs, k / 100) == pytest.approx(cuts[k - 1], rel=1e-9, abs=1e-6)


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 0.5))
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 0.0) == 1.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 1.0) == 4.0
    assert percentile([1.0, 2.0], 0.5) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_mean_and_cov() -> None:
    assert math.isnan(mean([])) and math.isnan(cov([]))
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert cov([0, 0]) == 0.0
    assert cov([2, 2, 2]) == 0.0
    assert cov([1, 3]) == pytest.approx(0.5)


def test_mean_ci95_matches_students_t() -> None:
    from bench.stats import mean_ci95

    m, h = mean_ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0
    # sd = sqrt(2.5), t(4 df) = 2.776: 2.776 * 1.5811 / sqrt(5)
    assert abs(h - 2.776 * math.sqrt(2.5) / math.sqrt(5)) < 1e-12
    assert math.isnan(mean_ci95([2.0])[1]) and mean_ci95([2.0])[0] == 2.0
    assert all(math.isnan(v) for v in mean_ci95([]))
    assert mean_ci95([1.0, 1.0, float("nan")]) == (1.0, 0.0)  # nan rows are left out
    # many values: the normal quantile
    xs = [float(i % 2) for i in range(100)]
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in xs) / 99)
    assert abs(mean_ci95(xs)[1] - 1.96 * sd / 10) < 1e-12
