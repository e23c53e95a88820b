"""LinkSchedule, the emulator's per-link core: FIFO, the cap over any window, delivery no
earlier than arrival + delay, the drop-tail bound on the backlog."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.testbed.link import UNLIMITED, LinkSchedule

MTU = 1500

offers = st.lists(  # (gap since the previous offer in seconds, packet size in bytes)
    st.tuples(st.floats(0, 0.01, allow_nan=False), st.integers(40, MTU)),
    min_size=1, max_size=200,
)
delays = st.sampled_from([0.0, 0.001, 0.02, 0.05])
rates = st.sampled_from([1e6, 20e6, 100e6])
backlogs = st.integers(MTU, 200_000)


def run(
    link: LinkSchedule, offered: list[tuple[float, int]],
) -> list[tuple[float, int, float | None]]:
    """(arrival, size, delivery or None) for each offer, arrivals the running sum of gaps."""
    now, out = 0.0, []
    for gap, size in offered:
        now += gap
        out.append((now, size, link.admit(now, size)))
    return out


@given(offers, delays, rates, backlogs)
def test_fifo_and_never_before_arrival_plus_delay_plus_serialisation(offered, delay, rate,
                                                                     backlog):
    link = LinkSchedule(delay, rate, backlog)
    delivered = [(t, size, at) for t, size, at in run(link, offered) if at is not None]
    times = [at for _, _, at in delivered]
    assert times == sorted(times)
    for t, size, at in delivered:
        assert at >= t + delay + size * 8 / rate - 1e-12


@given(offers, delays, rates, backlogs)
def test_delivered_rate_never_above_the_cap_over_any_window(offered, delay, rate, backlog):
    link = LinkSchedule(delay, rate, backlog)
    delivered = [(at, size) for _, size, at in run(link, offered) if at is not None]
    for (i, (start, _)), (j, (end, _)) in itertools.combinations(enumerate(delivered), 2):
        # packets i+1 .. j are serialised after packet i finished, inside [start, end]
        size = sum(s for _, s in delivered[i + 1:j + 1])
        assert size * 8 <= rate * (end - start) + 1e-6


@given(offers, delays, rates, backlogs)
def test_backlog_stays_bounded_and_a_drop_happens_only_when_full(offered, delay, rate, backlog):
    link = LinkSchedule(delay, rate, backlog)
    now = 0.0
    for gap, size in offered:
        now += gap
        before = link.backlog_bytes(now)
        at = link.admit(now, size)
        assert link.backlog_bytes(now) <= backlog + 1e-6
        assert (at is None) == (before + size > backlog)


def test_exact_times_for_a_burst():
    link = LinkSchedule(delay_s=0.02, bandwidth_bps=8000, max_backlog_bytes=2500)  # 1 kB/s
    assert link.admit(0.0, 1000) == pytest.approx(1.02)
    assert link.admit(0.0, 1000) == pytest.approx(2.02)
    assert link.admit(0.0, 1000) is None  # 2000 queued + 1000 > 2500
    assert link.admit(1.5, 1000) == pytest.approx(3.02)  # 500 left of the second: fits


def test_a_smaller_delay_does_not_reorder_and_no_cap_means_delay_only():
    link = LinkSchedule(delay_s=0.05, bandwidth_bps=UNLIMITED, max_backlog_bytes=MTU)
    assert link.admit(0.0, MTU) == pytest.approx(0.05)
    link.delay_s = 0.0
    assert link.admit(0.01, 100) == pytest.approx(0.05)  # not before the earlier packet
    assert link.admit(0.06, 100) == pytest.approx(0.06)


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        LinkSchedule(-0.001, 1e6, MTU)
    with pytest.raises(ValueError):
        LinkSchedule(0.0, 0.0, MTU)
    link = LinkSchedule(0.0, 1e6, MTU)
    with pytest.raises(ValueError):
        link.bandwidth_bps = -1.0
