"""The ranking core (peer/routing/cost.py): costs, ties, cycles, failures, properties."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.cost import (
    COST_TIE_FRACTION,
    ROUND_TRIPS_PER_FORWARD,
    PeerEstimate,
    estimate_cost,
    rank_estimates,
    swarm_busy,
    tie_limit_s,
)
from peer.routing.router import DEFAULT_RTT_PRIOR_S, Router
from tests.helpers_ranking import assert_cost_order

PROMPT = 1024  # tokens: 64 blocks of 16
NEW = 16


def est(
    peer_id: str,
    *,
    local: bool = False,
    match: int = 0,
    queued: int = 0,
    running: int = 0,
    prefill: float = 1000.0,
    decode: float = 20.0,
    rtt: float = 0.005,
    failed: float | None = None,
) -> PeerEstimate:
    return PeerEstimate(
        peer_id, local, match // 16, match, queued, running, prefill, decode,
        0.0 if local else rtt, failed_s_ago=failed,
    )


def order(policy: Policy, estimates: list[PeerEstimate], **kwargs: object) -> list[str]:
    rng = kwargs.pop("rng", random.Random(0))
    ranked = rank_estimates(policy, estimates, PROMPT, NEW, rng, **kwargs)  # type: ignore[arg-type]
    return [c.peer_id for c in ranked]


def test_cost_model_parts() -> None:
    cost = estimate_cost(256, 1024, 10, 500, 2, 1000.0, 20.0, 0.01)
    assert cost.network_s == pytest.approx(ROUND_TRIPS_PER_FORWARD * 0.01)
    assert cost.queue_s == pytest.approx(500 / 1000 + 2 * 10 / 20)
    assert cost.prefill_s == pytest.approx(768 / 1000)
    assert cost.decode_s == pytest.approx(10 / 20)
    assert cost.total_s == pytest.approx(cost.network_s + cost.queue_s + 0.768 + 0.5)
    # A fully cached prompt still computes one token; a zero speed cannot divide by zero.
    assert estimate_cost(1024, 1024, 1, 0, 0, 1000.0, 20.0, 0.0).prefill_s == 1 / 1000
    assert estimate_cost(0, 16, 1, 0, 0, 0.0, 0.0, 0.0).total_s > 1000
    # 512 of the tokens another peer holds are copied here: charged once more.
    copied = estimate_cost(256, 1024, 10, 500, 2, 1000.0, 20.0, 0.01, best_match_tokens=768)
    assert copied.prefill_s == pytest.approx((768 + 512) / 1000)
    busy = estimate_cost(256, 1024, 10, 0, 0, 1000.0, 20.0, 0.0, busy=1.0, best_match_tokens=768)
    assert busy.prefill_s == pytest.approx(2 * (768 + 512) / 1000)  # both delay the running
    assert estimate_cost(768, 1024, 10, 0, 0, 1000.0, 20.0, 0.0, best_match_tokens=256) == (
        estimate_cost(768, 1024, 10, 0, 0, 1000.0, 20.0, 0.0)  # no copy from a shorter match
    )


def test_cost_charges_the_copy_of_a_prefix_cached_elsewhere() -> None:
    me = est("me", local=True)
    # "a" holds the prompt behind 1.5 s of queue: 2.31 s against the local miss, 1.82 s
    # without the copy charge; with it, 2.85 s, so the request goes where its prefix is.
    ranked = rank_estimates(Policy.COST, [me, est("a", match=1024, queued=1500)], PROMPT, NEW,
                            random.Random(0))
    assert [c.peer_id for c in ranked] == ["a", "me"]
    assert ranked[1].cost.prefill_s == pytest.approx(2 * 1024 / 1000)
    # Nobody holds it: a plain miss everywhere, nothing to copy.
    ranked = rank_estimates(Policy.COST, [me, est("a")], PROMPT, NEW, random.Random(0))
    assert all(c.cost.prefill_s == pytest.approx(1024 / 1000) for c in ranked)


def test_local_policy_never_forwards() -> None:
    peers = [est("me", local=True, queued=10**6), est("a", match=1024)]
    assert order(Policy.LOCAL, peers) == ["me"]


def test_cost_prefers_matching_peer_until_its_queue_makes_it_slower() -> None:
    # Peer "a" holds the whole prompt; the local peer holds nothing. Prefill of 1024 tokens
    # at 1000 tok/s costs ~1 s and copying a's prefix here another ~1 s, so "a" wins while
    # its queue adds less than ~2 s.
    me = est("me", local=True)
    assert order(Policy.COST, [me, est("a", match=1024, queued=1500)])[0] == "a"
    ranked = rank_estimates(Policy.COST, [me, est("a", match=1024, queued=2500)], PROMPT, NEW,
                            random.Random(0))
    assert [c.peer_id for c in ranked] == ["me", "a"]
    assert ranked[0].cost_s < ranked[1].cost_s


def test_cost_running_requests_share_the_decoder() -> None:
    me = est("me", local=True)
    ranked = rank_estimates(Policy.COST, [me, est("a", match=1024, running=2)], PROMPT, NEW,
                            random.Random(0))
    by_id = {c.peer_id: c for c in ranked}
    # Each running stream shares the decoder: 2 * 16/20 s of queue on "a".
    assert by_id["a"].queue_s == pytest.approx(2 * NEW / 20)
    parts = by_id["a"].cost
    assert parts.total_s == pytest.approx(by_id["a"].cost_s)


def test_cost_near_ties_go_to_the_longest_match() -> None:
    me = est("me", local=True, match=512)
    # "a" holds the whole prompt but runs six streams: 4.8 s of sharing against the local
    # miss and copy of a's prefix, 512 tokens each, at 4 x 1 ms a token (busy = 3). 5.61 s
    # against 4.90 s is beyond a tie: the local peer.
    ranked = rank_estimates(Policy.COST, [me, est("a", match=1024, running=6)], PROMPT, NEW,
                            random.Random(0))
    assert [c.peer_id for c in ranked] == ["me", "a"]
    assert ranked[1].cost_s > tie_limit_s(ranked[0])
    # "b" holds it all, 0.5 s of network away (less than the 0.512 s the local miss
    # costs, so the copy is charged) with 0.6 s of prefill queued: 1.901 s against the
    # local 1.824 s (miss and copy 0.512 s each, decode 0.8 s). The tie band is 10% of
    # the cost less its decode (up to 1.926 s): a tie, so it goes first for its match;
    # the rest stays in cost order.
    b = est("b", match=1024, rtt=_rtt(0.5), queued=600)
    ranked = rank_estimates(Policy.COST, [me, b, est("c", match=0)], PROMPT, NEW,
                            random.Random(0))
    assert [c.peer_id for c in ranked] == ["b", "me", "c"]
    assert ranked[1].cost_s == pytest.approx(1.824)
    assert ranked[1].cost_s < ranked[0].cost_s <= tie_limit_s(ranked[1])
    assert tie_limit_s(ranked[1]) == pytest.approx(1.824 + COST_TIE_FRACTION * 1.024)


def _rtt(network_s: float) -> float:
    """The round-trip time at which a forward's priced network time is `network_s`."""
    return network_s / ROUND_TRIPS_PER_FORWARD


def test_a_prefix_farther_than_its_recomputation_is_replicated_not_shared() -> None:
    """REPLICATE: the local copy charge is waived when a forward to the nearest holder of
    the longest match costs at least the local recomputation in network time."""
    me = est("me", local=True, match=512)
    # "b" holds the whole prompt 0.6 s of network away: >= the 0.512 s the local miss
    # costs, so the local peer pays its miss (0.512 s) and decode (0.8 s), no copy.
    far = rank_estimates(Policy.COST, [me, est("b", match=1024, rtt=_rtt(0.6))], PROMPT, NEW,
                         random.Random(0))
    assert [c.peer_id for c in far] == ["me", "b"]
    assert far[0].cost_s == pytest.approx(0.512 + 0.8)
    # 0.4 s away (< 0.512 s): the copy is charged again (1.824 s) and b wins.
    near = rank_estimates(Policy.COST, [me, est("b", match=1024, rtt=_rtt(0.4))], PROMPT, NEW,
                          random.Random(0))
    assert [c.peer_id for c in near] == ["b", "me"]
    assert near[1].cost_s == pytest.approx(1.824)
    # The nearest holder counts: a second holder of the same match close by keeps it.
    both = rank_estimates(
        Policy.COST,
        [me, est("b", match=1024, rtt=_rtt(0.6)), est("c", match=1024, rtt=_rtt(0.4), queued=5000)],
        PROMPT, NEW, random.Random(0),
    )
    assert next(c for c in both if c.is_local).cost_s == pytest.approx(1.824)


def test_cost_charges_a_miss_for_the_requests_it_delays_in_a_busy_swarm() -> None:
    """busy = mean running requests per peer; a miss and a copy cost (1 + busy) times their
    prefill."""
    me = est("me", local=True)
    # "a" runs 2 (busy = 1): its 1.6 s of decode sharing < the local miss and copy,
    # 2 x 2.048 s.
    assert order(Policy.COST, [me, est("a", match=1024, running=2)])[0] == "a"
    # 6,000 prompt tokens queued on "a" as well: 8.41 s > 4.90 s, beyond a tie.
    assert order(Policy.COST, [me, est("a", match=1024, running=2, queued=6000)])[0] == "me"
    # An idle swarm charges plain prefill time.
    idle = estimate_cost(0, 1024, NEW, 0, 0, 1000.0, 20.0, 0.0)
    busy = estimate_cost(0, 1024, NEW, 0, 0, 1000.0, 20.0, 0.0, busy=2.0)
    assert busy.prefill_s == pytest.approx(3 * idle.prefill_s)
    assert swarm_busy([me, est("a", running=2), est("b", running=4)]) == pytest.approx(2.0)


def test_high_rtt_makes_cost_choose_local() -> None:
    me = est("me", local=True)
    assert order(Policy.COST, [me, est("a", match=1024, rtt=0.01)])[0] == "a"
    # 2.4 s of round trips outweigh the local miss and the copy (2 x 1.024 s).
    assert order(Policy.COST, [me, est("a", match=1024, rtt=1.2)])[0] == "me"


def test_cost_ties_go_to_local_then_peer_id() -> None:
    peers = [est("b"), est("me", local=True, match=0), est("a")]
    peers = [p._replace(rtt_s=0.0) for p in peers]
    assert order(Policy.COST, peers) == ["me", "a", "b"]


def test_longest_prefix_ties_broken_by_load() -> None:
    peers = [
        est("me", local=True, match=256),
        est("a", match=512, queued=900),
        est("b", match=512, queued=100),
        est("c", match=0),
    ]
    assert order(Policy.LONGEST_PREFIX, peers) == ["b", "a", "me", "c"]
    # The paper's policy ignores what the load costs: a huge queue still wins on match.
    peers[1] = est("a", match=528, queued=10**6)
    assert order(Policy.LONGEST_PREFIX, peers)[0] == "a"


def test_least_loaded_ignores_matches() -> None:
    peers = [
        est("me", local=True, match=1024, running=1),
        est("a", match=1024, queued=50),
        est("b", match=0, queued=10),
    ]
    ranked = rank_estimates(Policy.LEAST_LOADED, peers, PROMPT, NEW, random.Random(0))
    assert [c.peer_id for c in ranked] == ["b", "a", "me"]
    assert not ranked[0].matches_estimated and "match not estimated" in ranked[0].reason


def test_round_robin_cycles_through_all_peers_and_survives_departures() -> None:
    router = Router(Policy.ROUND_ROBIN, random.Random(0), block_size=16)
    peers = [est("me", local=True), est("a"), est("b"), est("c")]
    firsts = [router.rank_estimates(peers, PROMPT, NEW)[0].peer_id for _ in range(8)]
    assert firsts == ["a", "b", "c", "me", "a", "b", "c", "me"]
    ranked = router.rank_estimates(peers, PROMPT, NEW)
    assert [c.peer_id for c in ranked] == ["a", "b", "c", "me"]  # self last unless picked
    # "b" leaves after "a" was picked: the cycle goes on with "c".
    assert router.rank_estimates([peers[0], peers[1], peers[3]], PROMPT, NEW)[0].peer_id == "c"


def test_random_is_deterministic_under_a_seeded_rng_and_covers_everyone() -> None:
    peers = [est("me", local=True), est("a"), est("b"), est("c")]
    runs = [
        [order(Policy.RANDOM, peers, rng=rng)[0] for _ in range(50)]
        for rng in (random.Random(7), random.Random(7))
    ]
    assert runs[0] == runs[1]
    assert set(runs[0]) == {"me", "a", "b", "c"}
    for _ in range(20):
        ranked = order(Policy.RANDOM, peers, rng=random.Random(_))
        assert ranked[0] == "me" or ranked[-1] == "me"


def test_failed_peer_ranks_after_self_until_backoff_passes() -> None:
    router = Router(Policy.COST, random.Random(0), block_size=16, failure_backoff_s=10.0)
    router.record_outcome("a", ok=False, now=100.0)
    assert router.failed_s_ago("a", 105.0) == 5.0
    assert router.failed_s_ago("a", 110.0) is None
    peers = [est("me", local=True), est("a", match=1024, failed=router.failed_s_ago("a", 105.0)),
             est("b", match=512)]
    ranked = router.rank_estimates(peers, PROMPT, NEW)
    assert [c.peer_id for c in ranked] == ["b", "me", "a"]
    assert "failed 5.0 s ago" in ranked[2].reason
    router.record_outcome("a", ok=True, now=106.0)
    assert router.failed_s_ago("a", 106.0) is None
    assert router.statistics().failures_recorded == 1


def test_estimates_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        rank_estimates(Policy.COST, [est("a")], PROMPT, NEW, random.Random(0))
    with pytest.raises(ValueError, match="twice"):
        rank_estimates(Policy.COST, [est("me", local=True), est("a"), est("a")], PROMPT, NEW,
                       random.Random(0))


def test_reason_explains_the_choice() -> None:
    peer = est("a", match=512, queued=100, running=1)._replace(
        rtt_s=DEFAULT_RTT_PRIOR_S, rtt_known=False, forwards_since_summary=2
    )
    ranked = rank_estimates(Policy.COST, [est("me", local=True, match=32), peer], PROMPT, NEW,
                            random.Random(0))
    by_id = {c.peer_id: c.reason for c in ranked}
    assert "~32 blocks matched (Bloom)" in by_id["a"]
    assert "2 forward(s) since its summary" in by_id["a"]
    assert "(prior)" in by_id["a"]
    assert "self me" in by_id["me"] and "exact match 2 blocks" in by_id["me"]


# Properties over estimates.

peer_estimates = st.builds(
    est,
    st.text(alphabet="abcdefgh", min_size=1, max_size=3),
    match=st.integers(0, PROMPT),
    queued=st.integers(0, 10_000),
    running=st.integers(0, 8),
    prefill=st.floats(1.0, 1e5),
    decode=st.floats(1.0, 1e3),
    rtt=st.floats(0.0, 1.0),
    failed=st.none() | st.floats(0.0, 9.0),
)


@given(
    st.lists(peer_estimates, max_size=12, unique_by=lambda e: e.peer_id),
    st.sampled_from(Policy),
    st.integers(0, 2**32),
)
def test_every_policy_ranks_each_peer_once_with_self_included(
    remotes: list[PeerEstimate], policy: Policy, seed: int
) -> None:
    me = est("ME", local=True, match=64)
    ranked = rank_estimates(policy, [*remotes, me], PROMPT, NEW, random.Random(seed))
    ids = [c.peer_id for c in ranked]
    assert ids.count("ME") == 1
    if policy is Policy.LOCAL:
        assert ids == ["ME"]
        return
    assert sorted(ids) == sorted([*(r.peer_id for r in remotes), "ME"])
    # Peers that failed recently come after self; among the others self is never skipped
    # over by a peer it beats.
    suspects = {r.peer_id for r in remotes if r.failed_s_ago is not None}
    assert all(i > ids.index("ME") for i, p in enumerate(ids) if p in suspects)
    if policy is Policy.COST:
        assert_cost_order([c for c in ranked if c.peer_id not in suspects])
