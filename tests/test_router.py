"""Routing from a real PeerTable (peer/routing/router.py): summaries, Bloom matches,
priors, forwards."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.cost import aged_queue
from peer.routing.router import (
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
from peer.swarm.peer_table import QUEUE_MEAN_WEIGHT, PeerTable
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary
from tests.helpers_ranking import assert_cost_order

NEW = 16  # new tokens per request


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
        assert_cost_order(ranked)
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
            round(aged_queue(s.queued_prompt_tokens, view.queue_mean, s.prefill_tokens_per_s,
                             view.age_s)) + view.forwarded_prompt_tokens,
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
    best = max(e.match_tokens for e in estimates)
    holder_rtt = min((e.rtt_s for e in estimates[1:] if e.match_tokens == best), default=0.0)
    by_id = {e.peer_id: e for e in estimates}
    for c in rank_estimates(Policy.COST, estimates, prompt, new, random.Random(0)):
        e = by_id[c.peer_id]
        expected = estimate_cost(
            e.match_tokens, prompt, new, e.queued_prompt_tokens, e.running_requests,
            e.prefill_tokens_per_s, e.decode_tokens_per_s, e.rtt_s, busy=busy,
            best_match_tokens=best,
            holder_network_s=ROUND_TRIPS_PER_FORWARD * holder_rtt if e.is_local else 0.0,
        )
        assert c.cost_s == pytest.approx(expected.total_s)
        assert c.cost.prefill_s == pytest.approx(expected.prefill_s)
        assert c.queue_s == pytest.approx(expected.queue_s)


@settings(max_examples=200, deadline=None)
@given(
    reported=st.floats(0, 5000), usual=st.floats(0, 5000), prefill=st.floats(0, 20000),
    age=st.floats(0, 30), later=st.floats(0, 30),
)
def test_an_aging_queue_report_moves_from_itself_to_the_peers_usual_queue(
    reported: float, usual: float, prefill: float, age: float, later: float
) -> None:
    assert aged_queue(reported, usual, prefill, 0.0) == reported
    now = aged_queue(reported, usual, prefill, age)
    assert min(reported, usual) - 1e-6 <= now <= max(reported, usual) + 1e-6
    older = aged_queue(reported, usual, prefill, age + later)
    assert abs(older - usual) <= abs(now - usual) + 1e-6


def test_a_busy_peers_old_report_of_an_empty_queue_no_longer_draws_every_request() -> None:
    """Two peers hold the prompt's prefix at the same speed. peerA's reports said 2,000
    queued tokens, then its last one, two seconds ago, an empty queue; peerB reported 500
    just now. At 10,000 tokens/s a queue turns over in a fraction of a second, so the old
    report counts as peerA's usual queue and peerB wins; while both are fresh, the empty
    queue does."""
    chain = chain_of(32)
    now = 10.0

    def ranked(empty_age: float) -> list[str]:
        table = PeerTable(SELF, MODEL, BS, 6.0)
        for i in range(5):  # peerA's history: long queues
            s = summary("peerA", chain, queued=2000, prefill=10_000.0, decode=100.0, seq=i)
            assert table.apply(s, "peerA", now - empty_age - 5 + i).accepted
        for peer_id, queued, age, seq in (("peerA", 0, empty_age, 9), ("peerB", 500, 0.0, 1)):
            s = summary(peer_id, chain, queued=queued, prefill=10_000.0, decode=100.0, seq=seq)
            assert table.apply(s, peer_id, now - age).accepted
            table.record_rtt(peer_id, 0.002, now - age)
        router = Router(Policy.COST, random.Random(0), block_size=BS)
        local = LocalState(SELF, 0, 0, 0, 10_000.0, 100.0)
        return [c.peer_id for c in router.rank(chain, 32 * BS + 5, NEW, local, table, now)]

    fresh, old = ranked(0.0), ranked(2.0)
    assert fresh.index("peerA") < fresh.index("peerB")
    assert old.index("peerB") < old.index("peerA")


def test_a_peers_usual_queue_is_moved_by_its_own_reports_only() -> None:
    table = PeerTable(SELF, MODEL, BS, 6.0)
    chain = chain_of(4)
    assert table.apply(summary("peerA", chain, queued=100, seq=1), "peerA", 1.0).accepted
    assert table.apply(summary("peerB", chain, queued=2**40, seq=1), "peerB", 1.0).accepted
    assert table.apply(summary("peerA", chain, queued=300, seq=2), "peerA", 2.0).accepted
    view = table.get("peerA", 2.0)
    assert view is not None
    assert view.queue_mean == pytest.approx(100 + QUEUE_MEAN_WEIGHT * 200)
