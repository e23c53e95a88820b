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
