"""Routing policies in virtual time: costs, ties, cycles, failures, and table-fed ranking."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.config import Policy
from peer.peer_table import PeerTable
from peer.ranking import COST_TIE_FRACTION
from peer.router import (
    DEFAULT_DECODE_TOKENS_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_RTT_PRIOR_S,
    ROUND_TRIPS_PER_FORWARD,
    SPEED_NOISE_FACTOR,
    Candidate,
    LocalState,
    PeerEstimate,
    Router,
    estimate_cost,
    rank_estimates,
    swarm_busy,
)
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary

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


def test_local_policy_never_forwards() -> None:
    peers = [est("me", local=True, queued=10**6), est("a", match=1024)]
    assert order(Policy.LOCAL, peers) == ["me"]


def test_cost_prefers_matching_peer_until_its_queue_makes_it_slower() -> None:
    # Peer "a" holds the whole prompt; the local peer holds nothing. Prefill of 1024 tokens
    # at 1000 tok/s costs ~1 s, so "a" wins while its queue adds less than that.
    me = est("me", local=True)
    assert order(Policy.COST, [me, est("a", match=1024, queued=500)])[0] == "a"
    ranked = rank_estimates(Policy.COST, [me, est("a", match=1024, queued=1500)], PROMPT, NEW,
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
    # "a" holds the whole prompt but runs two streams: 1.6 s of sharing against the local
    # miss of 2 x 0.512 s (busy = 1). 2.41 s against 1.82 s is beyond a tie: the local peer.
    ranked = rank_estimates(Policy.COST, [me, est("a", match=1024, running=2)], PROMPT, NEW,
                            random.Random(0))
    assert [c.peer_id for c in ranked] == ["me", "a"]
    assert ranked[1].cost_s > ranked[0].cost_s * (1 + COST_TIE_FRACTION)
    # "b" holds it all and is idle, but 0.56 s away: 1.36 s against the local 1.31 s, a
    # tie, so it goes first for its match; the rest stays in cost order.
    b = est("b", match=1024, rtt=0.28)
    ranked = rank_estimates(Policy.COST, [me, b, est("c", match=0)], PROMPT, NEW,
                            random.Random(0))
    assert [c.peer_id for c in ranked] == ["b", "me", "c"]
    assert ranked[1].cost_s < ranked[0].cost_s <= ranked[1].cost_s * (1 + COST_TIE_FRACTION)


def test_cost_charges_a_miss_for_the_requests_it_delays_in_a_busy_swarm() -> None:
    """busy = mean running requests per peer; a miss costs (1 + busy) times its prefill."""
    me = est("me", local=True)
    # "a" runs 2 (busy = 1): its 1.6 s of decode sharing < the local miss, 2 x 1.024 s.
    assert order(Policy.COST, [me, est("a", match=1024, running=2)])[0] == "a"
    # "a" runs 6 (busy = 3): 4.8 s of sharing > 4 x 1.024 s, by more than a tie: the miss
    # is now cheaper.
    assert order(Policy.COST, [me, est("a", match=1024, running=6)])[0] == "me"
    # An idle swarm charges plain prefill time.
    idle = estimate_cost(0, 1024, NEW, 0, 0, 1000.0, 20.0, 0.0)
    busy = estimate_cost(0, 1024, NEW, 0, 0, 1000.0, 20.0, 0.0, busy=2.0)
    assert busy.prefill_s == pytest.approx(3 * idle.prefill_s)
    assert swarm_busy([me, est("a", running=2), est("b", running=4)]) == pytest.approx(2.0)


def test_high_rtt_makes_cost_choose_local() -> None:
    me = est("me", local=True)
    assert order(Policy.COST, [me, est("a", match=1024, rtt=0.01)])[0] == "a"
    assert order(Policy.COST, [me, est("a", match=1024, rtt=0.7)])[0] == "me"


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
        # Cheapest first, except that a near tie goes to the longest match: the first is
        # within the tie margin of the cheapest and matches the most among those; the
        # rest are in cost order.
        healthy = [c for c in ranked if c.peer_id not in suspects]
        cheapest = min(c.cost_s for c in healthy)
        tied = [c for c in healthy if c.cost_s <= cheapest * (1 + COST_TIE_FRACTION)]
        assert healthy[0] in tied
        assert healthy[0].match_blocks == max(c.match_blocks for c in tied)
        rest = [c.cost_s for c in healthy[1:]]
        assert rest == sorted(rest)


# Ranking from a real PeerTable with real summaries and Bloom filters.

BS = 16
MODEL = "test-model"
SELF = "12D3KooWself"


def chain_of(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(salt)
    return [rng.getrandbits(64) for _ in range(n)]


def summary(
    peer_id: str,
    held: list[int],
    *,
    seq: int = 1,
    queued: int = 0,
    running: int = 0,
    prefill: float = 1000.0,
    decode: float = 20.0,
) -> CacheSummary:
    bloom = BloomFilter.for_capacity(2000, 0.01)
    bloom.update(held)
    return CacheSummary(
        peer_id=peer_id, model_id=MODEL, block_size=BS, seq=seq, bloom_bits=bloom.num_bits,
        bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(), cached_blocks=len(set(held)),
        capacity_blocks=2000, queued_prompt_tokens=queued, running_requests=running,
        prefill_tokens_per_s=prefill, decode_tokens_per_s=decode,
    )


def table_with(*summaries: CacheSummary, now: float = 0.0, expiry: float = 6.0) -> PeerTable:
    table = PeerTable(SELF, MODEL, BS, expiry)
    for s in summaries:
        assert table.apply(s, s.peer_id, now).accepted
    return table


def me(match: int = 0, *, queued: int = 0, running: int = 0) -> LocalState:
    return LocalState(SELF, match, queued, running, 1000.0, 20.0)


def test_table_matches_are_bloom_estimates_and_local_is_exact() -> None:
    chain = chain_of(64)
    table = table_with(summary("peerA", chain[:40]), summary("peerB", chain[:10]))
    for peer_id in ("peerA", "peerB"):
        table.record_rtt(peer_id, 0.002, 0.0)
    router = Router(Policy.LONGEST_PREFIX, random.Random(0), block_size=BS)
    ranked = router.rank(chain, 64 * BS, NEW, me(match=20 * BS), table, 1.0)
    assert [(c.peer_id, c.match_blocks) for c in ranked] == [
        ("peerA", 40), (SELF, 20), ("peerB", 10)
    ]
    assert ranked[0].match_tokens == 40 * BS
    assert ranked[0].cost.total_s == ranked[0].cost_s


def test_forwards_since_summary_shift_the_choice_until_the_next_summary() -> None:
    chain = chain_of(64)
    table = table_with(summary("peerA", chain), summary("peerB", chain))
    router = Router(Policy.COST, random.Random(0), block_size=BS)
    first = router.rank(chain, 64 * BS, NEW, me(), table, 1.0)[0]
    assert first.peer_id == "peerA"  # equal in everything: the lower id
    table.record_forward("peerA", 64 * BS, 1.0)
    ranked = router.rank(chain, 64 * BS, NEW, me(), table, 1.1)
    assert ranked[0].peer_id == "peerB"
    by_id = {c.peer_id: c for c in ranked}
    assert by_id["peerA"].estimate.queued_prompt_tokens == 64 * BS
    assert by_id["peerA"].estimate.running_requests == 1
    assert "1 forward(s) since its summary" in by_id["peerA"].reason
    # A's next summary reports its load itself (here: idle again): forwards reset.
    assert table.apply(summary("peerA", chain, seq=2), "peerA", 2.0).accepted
    assert router.rank(chain, 64 * BS, NEW, me(), table, 2.0)[0].peer_id == "peerA"


def test_unknown_rtt_takes_the_prior_and_measured_rtt_replaces_it() -> None:
    chain = chain_of(8)
    table = table_with(summary("peerA", chain))
    router = Router(Policy.COST, random.Random(0), block_size=BS, rtt_prior_s=0.4)
    prompt = 8 * BS  # small: 128 tokens of prefill saved (0.128 s) vs 2 * 0.4 s of network
    assert router.rank(chain, prompt, 1, me(), table, 1.0)[0].peer_id == SELF
    table.record_rtt("peerA", 0.001, 1.0)
    ranked = router.rank(chain, prompt, 1, me(), table, 1.0)
    assert ranked[0].peer_id == "peerA"
    assert ranked[0].estimate.rtt_s == 0.001 and ranked[0].estimate.rtt_known


def test_unknown_speeds_take_the_local_measurement_then_the_defaults() -> None:
    table = table_with(summary("peerA", [], prefill=0.0, decode=0.0))
    router = Router(Policy.COST, random.Random(0), block_size=BS)
    ranked = router.rank([], 10, 1, LocalState(SELF, 0, 0, 0, 123.0, 4.5), table, 1.0)
    peer = next(c for c in ranked if c.peer_id == "peerA").estimate
    assert (peer.prefill_tokens_per_s, peer.decode_tokens_per_s) == (123.0, 4.5)
    assert not peer.speeds_known
    ranked = router.rank([], 10, 1, LocalState(SELF, 0, 0, 0, 0.0, 0.0), table, 1.0)
    peer = next(c for c in ranked if c.peer_id == "peerA").estimate
    assert peer.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S
    assert peer.decode_tokens_per_s == DEFAULT_DECODE_TOKENS_PER_S


def test_local_policy_ignores_the_table() -> None:
    chain = chain_of(8)
    table = table_with(summary("peerA", chain))
    router = Router(Policy.LOCAL, random.Random(0), block_size=BS)
    assert [c.peer_id for c in router.rank(chain, 8 * BS, 1, me(), table, 1.0)] == [SELF]


def test_expired_peers_are_never_candidates() -> None:
    chain = chain_of(8)
    table = table_with(summary("peerA", chain), now=0.0, expiry=6.0)
    router = Router(Policy.COST, random.Random(0), block_size=BS)
    assert "peerA" in [c.peer_id for c in router.rank(chain, 8 * BS, 1, me(), table, 5.9)]
    assert [c.peer_id for c in router.rank(chain, 8 * BS, 1, me(), table, 6.0)] == [SELF]


def test_rank_rejects_a_chain_longer_than_the_prompt() -> None:
    router = Router(Policy.COST, random.Random(0), block_size=BS)
    with pytest.raises(ValueError, match="longer than the prompt"):
        router.rank(chain_of(2), BS, 1, me(), table_with(), 0.0)


@settings(max_examples=40, deadline=None)
@given(
    peers=st.lists(
        st.tuples(
            st.integers(0, 16),  # blocks of the prompt it holds
            st.floats(0.0, 10.0),  # when its summary arrived
            st.integers(0, 3),  # forwards since
            st.integers(0, 5000),  # queued tokens
            st.none() | st.floats(0.0, 0.2),  # measured rtt
        ),
        max_size=8,
    ),
    local_blocks=st.integers(0, 16),
    policy=st.sampled_from(Policy),
    now=st.floats(6.0, 16.0),
)
def test_rank_from_table_properties(
    peers: list[tuple[int, float, int, int, float | None]],
    local_blocks: int,
    policy: Policy,
    now: float,
) -> None:
    chain = chain_of(16)
    expiry = 6.0
    table = PeerTable(SELF, MODEL, BS, expiry)
    live = set()
    for i, (depth, at, forwards, queued, rtt) in enumerate(peers):
        peer_id = f"peer{i}"
        assert table.apply(summary(peer_id, chain[:depth], queued=queued), peer_id, at).accepted
        for _ in range(forwards):
            table.record_forward(peer_id, 100, at)
        if rtt is not None:
            table.record_rtt(peer_id, rtt, at)
        if now - at < expiry:
            live.add(peer_id)
    router = Router(policy, random.Random(0), block_size=BS)
    ranked = router.rank(chain, 16 * BS + 5, NEW, me(local_blocks * BS), table, now)
    ids = [c.peer_id for c in ranked]
    assert ids.count(SELF) == 1
    assert set(ids) == ({SELF} if policy is Policy.LOCAL else live | {SELF})
    if policy is Policy.COST:
        costs = [c.cost_s for c in ranked]
        assert costs == sorted(costs)
    if policy is Policy.LONGEST_PREFIX:
        matches = [c.match_blocks for c in ranked]
        assert matches == sorted(matches, reverse=True)
        assert ranked[0].match_blocks >= local_blocks


def as_measured_here(remote: float, ours: float) -> float:
    """Unknown speeds, and speeds within SPEED_NOISE_FACTOR of ours, count as ours."""
    if remote <= 0 or ours / SPEED_NOISE_FACTOR <= remote <= ours * SPEED_NOISE_FACTOR:
        return ours
    return remote


def reference_rank(
    router: Router, policy: Policy, chain: list[int], prompt: int, new: int,
    local: LocalState, table: PeerTable, now: float, rng: random.Random,
) -> list[Candidate]:
    """rank() spelled out the slow way: views, one Bloom walk per peer, rank_estimates."""
    estimates = [router.local_estimate(local)]
    for view in table.views(now) if policy is not Policy.LOCAL else []:
        s = view.summary
        match = table.estimate_match(view.peer_id, chain) if policy in USES_MATCHES else 0
        ours = router.local_estimate(local)
        prefill = as_measured_here(s.prefill_tokens_per_s, ours.prefill_tokens_per_s)
        decode = as_measured_here(s.decode_tokens_per_s, ours.decode_tokens_per_s)
        estimates.append(PeerEstimate(
            view.peer_id, False, match, match * BS,
            s.queued_prompt_tokens + view.forwarded_prompt_tokens,
            s.running_requests + view.forwards_since_summary, prefill, decode,
            DEFAULT_RTT_PRIOR_S if view.rtt_s is None else view.rtt_s, view.rtt_s is not None,
            s.prefill_tokens_per_s > 0 and s.decode_tokens_per_s > 0,
            view.forwards_since_summary, router.failed_s_ago(view.peer_id, now),
        ))
    return rank_estimates(policy, estimates, prompt, new, rng)


USES_MATCHES = {Policy.COST, Policy.LONGEST_PREFIX}


@settings(max_examples=60, deadline=None)
@given(
    peers=st.lists(
        st.tuples(
            st.integers(0, 24),  # blocks of the chain it holds
            st.integers(0, 400),  # unrelated blocks: Bloom false positives along the chain
            st.sampled_from([300, 2000]),  # capacity: two filter shapes
            st.floats(0.0, 10.0),  # when its summary arrived
            st.integers(0, 3),  # forwards since
            st.none() | st.floats(0.0, 0.2),  # measured rtt
            st.sampled_from([0.0, 500.0, 800.0]),  # reported speeds (0: unknown)
            st.none() | st.floats(0.0, 12.0),  # when it last failed
        ),
        max_size=10,
    ),
    chain_blocks=st.integers(0, 24),
    local=st.tuples(st.integers(0, 24), st.sampled_from([0.0, 300.0])),
    policy=st.sampled_from([Policy.COST, Policy.LONGEST_PREFIX, Policy.LEAST_LOADED,
                            Policy.LOCAL]),
    now=st.floats(6.0, 14.0),
    seed=st.integers(0, 2**16),
)
def test_rank_equals_the_reference_built_from_views_and_per_peer_walks(
    peers: list[tuple[int, int, int, float, int, float | None, float, float | None]],
    chain_blocks: int,
    local: tuple[int, float],
    policy: Policy,
    now: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    chain = chain_of(chain_blocks, salt=seed)
    table = PeerTable(SELF, MODEL, BS, 6.0)
    router = Router(policy, random.Random(0), block_size=BS)
    for i, (depth, noise, cap, at, forwards, rtt, speed, failed_at) in enumerate(peers):
        peer_id = f"peer{i}"
        bloom = BloomFilter.for_capacity(cap, 0.05)
        held = chain[:depth] + [rng.getrandbits(64) for _ in range(min(noise, cap))]
        bloom.update(held)
        s = CacheSummary(
            peer_id=peer_id, model_id=MODEL, block_size=BS, seq=1, bloom_bits=bloom.num_bits,
            bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(),
            cached_blocks=len(set(held)), capacity_blocks=cap,
            queued_prompt_tokens=rng.randrange(3000), running_requests=rng.randrange(3),
            prefill_tokens_per_s=speed, decode_tokens_per_s=speed / 40,
        )
        assert table.apply(s, peer_id, at).accepted
        for _ in range(forwards):
            table.record_forward(peer_id, 100, at)
        if rtt is not None:
            table.record_rtt(peer_id, rtt, at)
        if failed_at is not None and failed_at <= now:
            router.record_outcome(peer_id, False, failed_at)
    state = LocalState(SELF, min(local[0], chain_blocks) * BS, 100, 1, local[1], local[1] / 40)
    prompt = max(chain_blocks * BS + 3, 1)
    got = router.rank(chain, prompt, NEW, state, table, now)
    expected = reference_rank(router, policy, chain, prompt, NEW, state, table, now,
                              random.Random(0))
    assert got == expected


def _speed_table(remote_prefill: float) -> PeerTable:
    table = PeerTable(SELF, MODEL, BS, 6.0)
    bloom = BloomFilter.for_capacity(300, 0.01)
    table.apply(
        CacheSummary(
            peer_id="fast", model_id=MODEL, block_size=BS, seq=1, bloom_bits=bloom.num_bits,
            bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(), cached_blocks=0,
            capacity_blocks=300, queued_prompt_tokens=0, running_requests=0,
            prefill_tokens_per_s=remote_prefill, decode_tokens_per_s=remote_prefill / 40,
        ),
        "fast",
        0.0,
    )
    table.record_rtt("fast", 0.002, 0.0)
    return table


@pytest.mark.parametrize(
    ("remote_prefill", "first"),
    [(900.0, SELF), (1900.0, SELF), (2100.0, "fast"), (5000.0, "fast")],
)
def test_cost_ignores_speed_differences_within_measurement_noise(remote_prefill, first):
    """Ours measured 1000 tok/s. A cold prompt goes to another peer only if that peer is
    faster by more than the noise factor (2x), not because it measured itself a bit faster."""
    router = Router(Policy.COST, random.Random(0), block_size=BS)
    local = LocalState(SELF, 0, 0, 0, 1000.0, 25.0)
    chain = chain_of(30, salt=7)
    ranked = router.rank(chain, 30 * BS, 4, local, _speed_table(remote_prefill), 1.0)
    assert SPEED_NOISE_FACTOR == 2.0
    assert ranked[0].peer_id == first


@settings(max_examples=80, deadline=None)
@given(
    peers=st.lists(
        st.tuples(
            st.integers(0, 2048),  # match tokens
            st.integers(0, 5000),  # queued prompt tokens
            st.integers(0, 6),  # running requests
            st.floats(10.0, 5000.0),  # prefill tokens/s
            st.floats(1.0, 100.0),  # decode tokens/s
            st.floats(0.0, 0.3),  # rtt
        ),
        min_size=1,
        max_size=8,
    ),
    new=st.integers(1, 64),
)
def test_ranked_costs_are_estimate_cost_with_the_swarm_busy(
    peers: list[tuple[int, int, int, float, float, float]], new: int
) -> None:
    """The cost formula is inlined in the ranking loops for speed; it must stay
    estimate_cost's (with busy = swarm_busy of the candidates), part by part."""
    estimates = [
        PeerEstimate(f"p{i}", i == 0, m // BS, m, q, r, pf, dc, 0.0 if i == 0 else rtt)
        for i, (m, q, r, pf, dc, rtt) in enumerate(peers)
    ]
    prompt = 2048
    busy = swarm_busy(estimates)
    by_id = {e.peer_id: e for e in estimates}
    for c in rank_estimates(Policy.COST, estimates, prompt, new, random.Random(0)):
        e = by_id[c.peer_id]
        expected = estimate_cost(
            e.match_tokens, prompt, new, e.queued_prompt_tokens, e.running_requests,
            e.prefill_tokens_per_s, e.decode_tokens_per_s, e.rtt_s, busy=busy,
        )
        assert c.cost_s == pytest.approx(expected.total_s)
        assert c.cost.prefill_s == pytest.approx(expected.prefill_s)
        assert c.queue_s == pytest.approx(expected.queue_s)
