"""A forward's overhead at its entry: learned from the entry's clock, and how it ranks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.cost import ROUND_TRIPS_PER_FORWARD, PeerEstimate, rank_estimates
from peer.routing.forward_overhead import (
    MAX_PEERS,
    OVERHEAD_BOUND_S,
    ForwardOverhead,
    unexplained_wait,
)


def test_nothing_is_added_before_a_forward() -> None:
    assert ForwardOverhead().extra_s == 0.0


def _setup(rtt_s: float) -> float:
    """The round trips the cost model counts before a forward's request goes out."""
    return (ROUND_TRIPS_PER_FORWARD - 1) * rtt_s


def test_the_wait_beyond_the_modelled_round_trips_is_learned() -> None:
    o = ForwardOverhead()
    o.forwarded(0.05 + _setup(0.02), 0.02, 0.01)  # 50 ms before the request went out
    assert o.extra_s == pytest.approx(0.06)
    for _ in range(200):
        o.forwarded(0.10 + _setup(0.02), 0.02, 0.03)
    assert o.extra_s == pytest.approx(0.13, abs=1e-3)


def test_a_request_sent_at_once_adds_nothing() -> None:
    o = ForwardOverhead()
    o.forwarded(0.5 * _setup(0.05), 0.05, 0.0)
    assert o.extra_s == 0.0


def test_the_wait_beyond_the_round_trip_and_the_serving_engine_is_learned_per_peer() -> None:
    # 0.12 s from the request to its first token: 0.02 the round trip, 0.05 the serving
    # engine's own time, so 0.05 was the stream's handling at both ends
    assert unexplained_wait(0.12, 0.02, 0.05) == pytest.approx(0.05)
    o = ForwardOverhead()
    o.forwarded(0.01 + _setup(0.02), 0.02, 0.0, peer_id="slow", first_wait_s=0.12,
                server_ttft_s=0.05)
    o.forwarded(0.01 + _setup(0.02), 0.02, 0.0, peer_id="quick", first_wait_s=0.07,
                server_ttft_s=0.05)
    assert o.extra_s == pytest.approx(0.01)  # the entry's own waits: every peer
    assert o.extra_for("slow") == pytest.approx(0.06)
    assert o.extra_for("quick") == pytest.approx(0.01)
    assert o.extra_for("never") == pytest.approx(0.01)
    for _ in range(70):  # serving here fades the peers' means too
        o.served_here()
    assert o.extra_for("slow") - o.extra_s == pytest.approx(0.05 * 0.99**70)


def test_an_unknown_or_overstated_engine_time_adds_nothing() -> None:
    assert unexplained_wait(None, 0.02, 0.05) is None
    assert unexplained_wait(0.12, 0.02, None) is None
    assert unexplained_wait(float("nan"), 0.02, 0.0) is None
    assert unexplained_wait(0.1, 0.02, float("inf")) is None
    assert unexplained_wait(0.12, 0.02, 5.0) == pytest.approx(-0.02)  # at most the wait
    o = ForwardOverhead()
    o.forwarded(0.0, 0.02, 0.0, peer_id="liar", first_wait_s=0.12, server_ttft_s=5.0)
    assert o.extra_for("liar") == o.extra_s == 0.0


def test_jitter_either_way_averages_out_instead_of_adding_up() -> None:
    # first tokens 5 ms sooner and 5 ms later than the round trip priced, in turn: the
    # mean stays near zero (a mean of only the late ones would price 2.5 ms a forward)
    o = ForwardOverhead()
    for i in range(200):
        late = 0.005 if i % 2 else -0.005
        o.forwarded(0.0, 0.02, 0.0, peer_id="p", first_wait_s=0.07 + late, server_ttft_s=0.05)
    assert o.extra_for("p") < 0.001


@given(st.floats(0, 5), st.floats(0, 1), st.floats(0, 5), st.floats(0, 5),
       st.floats(0, 100) | st.just(float("inf")) | st.none())
def test_a_serving_peer_cannot_push_its_cost_below_the_entrys_own_waits(
    before: float, rtt: float, after: float, wait: float, reported: float | None,
) -> None:
    own, told = ForwardOverhead(), ForwardOverhead()
    own.forwarded(before, rtt, after)
    told.forwarded(before, rtt, after, peer_id="p", first_wait_s=wait, server_ttft_s=reported)
    assert told.extra_for("p") >= own.extra_s == told.extra_s
    assert told.extra_for("p") <= 2 * OVERHEAD_BOUND_S


def test_the_peers_remembered_are_bounded() -> None:
    o = ForwardOverhead()
    for i in range(MAX_PEERS + 10):
        o.forwarded(0.0, 0.0, 0.0, peer_id=f"p{i}", first_wait_s=0.1, server_ttft_s=0.0)
    assert o.extra_for("p0") == 0.0  # the least recently forwarded to: forgotten
    assert o.extra_for(f"p{MAX_PEERS + 9}") == pytest.approx(0.1)


def test_serving_here_fades_it_so_forwarding_is_tried_again() -> None:
    o = ForwardOverhead()
    o.forwarded(0.5, 0.0, 0.0)
    for _ in range(70):
        o.served_here()
    assert 0.2 < o.extra_s < 0.5 * 0.5


def test_one_outlier_moves_the_mean_by_a_bounded_amount() -> None:
    o = ForwardOverhead()
    for _ in range(100):
        o.forwarded(0.01 + _setup(0.02), 0.02, 0.0)
    o.forwarded(100.0, 0.02, 0.0)  # a verification that waited on a busy engine
    assert o.extra_s <= 0.01 + o.weight * OVERHEAD_BOUND_S + 1e-9


@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 1), st.floats(0, 10)), max_size=60))
def test_the_extra_stays_within_zero_and_the_bound(
    samples: list[tuple[float, float, float]],
) -> None:
    o = ForwardOverhead()
    for before, rtt, after in samples:
        o.forwarded(before, rtt, after)
        o.served_here()
    assert 0.0 <= o.extra_s <= OVERHEAD_BOUND_S


def test_bad_times_are_refused() -> None:
    with pytest.raises(ValueError):
        ForwardOverhead().forwarded(float("nan"), 0.0, 0.0)
    with pytest.raises(ValueError):
        ForwardOverhead().forwarded(0.1, -1.0, 0.0)
    with pytest.raises(ValueError):
        ForwardOverhead(weight=0)


def _estimates(extra_s: float) -> list[PeerEstimate]:
    local = PeerEstimate("self", True, 0, 0, 0, 0, 5000.0, 50.0, 0.0)
    holder = PeerEstimate("holder", False, 30, 480, 0, 0, 5000.0, 50.0, 0.01, extra_s=extra_s)
    return [local, holder]


def test_the_extra_can_turn_a_forward_into_serving_here() -> None:
    rng = random.Random(0)
    # 512 tokens: 0.1 s here; the holder has 480 of them, round trips of 10 ms away
    assert not rank_estimates(Policy.COST, _estimates(0.0), 512, 4, rng)[0].is_local
    ranked = rank_estimates(Policy.COST, _estimates(0.2), 512, 4, rng)
    assert ranked[0].is_local
    holder = next(c for c in ranked if not c.is_local)
    assert holder.cost.network_s == pytest.approx(ROUND_TRIPS_PER_FORWARD * 0.01 + 0.2)
