"""PeerTable in virtual time: validation verdicts, seq ordering, expiry, forwards, matches."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.swarm.peer_table import (
    MAX_BANK_BYTES,
    MAX_PEERS,
    RTT_WINDOW,
    PeerTable,
    Verdict,
)
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SELF = "12D3KooWSelf"
A = "12D3KooWPeerA"
B = "12D3KooWPeerB"
INTERVAL = 2.0
EXPIRY = 3 * INTERVAL


def summary(
    peer_id: str = A,
    seq: int = 1,
    keys: list[int] | None = None,
    *,
    capacity: int = 200,
    cached_blocks: int | None = None,
    bloom: BloomFilter | None = None,
    model_id: str = MODEL,
    block_size: int = 16,
) -> CacheSummary:
    keys = list(range(1000, 1050)) if keys is None else keys
    if bloom is None:
        bloom = BloomFilter.for_capacity(capacity)
        bloom.update(keys)
    return CacheSummary(
        peer_id=peer_id,
        model_id=model_id,
        block_size=block_size,
        seq=seq,
        bloom_bits=bloom.num_bits,
        bloom_hashes=bloom.num_hashes,
        bloom=bloom.to_bytes(),
        cached_blocks=len(keys) if cached_blocks is None else cached_blocks,
        capacity_blocks=capacity,
        queued_prompt_tokens=0,
        running_requests=0,
        prefill_tokens_per_s=500.0,
        decode_tokens_per_s=15.0,
    )


def table() -> PeerTable:
    return PeerTable(self_id=SELF, model_id=MODEL, block_size=16, expiry_s=EXPIRY)


def test_accepts_new_peer_then_updates() -> None:
    t = table()
    first = t.apply(summary(seq=1), A, now=10.0)
    assert (first.accepted, first.reason) == (True, Verdict.NEW_PEER)
    second = t.apply(summary(seq=2), A, now=12.0)
    assert (second.accepted, second.reason) == (True, Verdict.UPDATED)
    [view] = t.views(now=13.0)
    assert (view.peer_id, view.summary.seq, view.received_at, view.age_s) == (A, 2, 12.0, 1.0)
    assert t.get(A, now=13.0) == view
    assert t.get(B, now=13.0) is None


@pytest.mark.parametrize(
    ("make", "source", "verdict"),
    [
        (lambda: summary(peer_id=A), B, Verdict.IDENTITY),
        (lambda: summary(peer_id=SELF), SELF, Verdict.SELF),
        (lambda: summary(model_id="other/model"), A, Verdict.MODEL),
        (lambda: summary(block_size=32), A, Verdict.BLOCK_SIZE),
        (lambda: summary(cached_blocks=5), A, Verdict.BLOOM_INCONSISTENT),  # fill too high
        (lambda: summary(cached_blocks=180), A, Verdict.BLOOM_INCONSISTENT),  # fill too low
        (
            lambda: summary(
                bloom=BloomFilter.from_bytes(4096, 3, b"\xff" * 480 + bytes(32)),
                cached_blocks=10_000,
            ),
            A,
            Verdict.BLOOM_TOO_FULL,
        ),
    ],
)
def test_rejections_have_stable_reasons(make: object, source: str, verdict: Verdict) -> None:
    t = table()
    result = t.apply(make(), source, now=0.0)  # type: ignore[operator]
    assert not result.accepted
    assert result.reason == verdict
    assert result.reason.value == str(result.reason)  # usable as a metrics label
    assert result.detail
    assert t.views(now=0.0) == []
    assert t.statistics()[f"apply_{verdict}"] == 1


def test_fill_check_tolerates_sampling_noise() -> None:
    rng = random.Random(3)
    t = table()
    for i, n in enumerate((0, 1, 5, 60, 200, 400)):  # up to twice the capacity
        keys = [rng.getrandbits(64) for _ in range(n)]
        assert t.apply(summary(peer_id=f"Peer{i}", keys=keys), f"Peer{i}", now=0.0).accepted


def test_seq_must_strictly_increase_while_live() -> None:
    t = table()
    assert t.apply(summary(seq=5), A, now=0.0).accepted
    for seq in (5, 4, 0):
        result = t.apply(summary(seq=seq), A, now=1.0)
        assert (result.accepted, result.reason) == (False, Verdict.STALE_SEQ)
    assert t.get(A, now=1.0).summary.seq == 5  # type: ignore[union-attr]
    assert t.apply(summary(seq=6), A, now=1.0).accepted


def test_expiry_exactly_after_three_intervals() -> None:
    t = table()
    t.apply(summary(seq=1), A, now=100.0)
    just_before = 100.0 + EXPIRY - 1e-9
    assert t.expire(just_before) == []
    assert [v.peer_id for v in t.views(just_before)] == [A]
    assert t.views(100.0 + EXPIRY) == []  # stale counts as gone even before expire()
    assert t.expire(100.0 + EXPIRY) == [A]
    assert t.expire(100.0 + EXPIRY) == []
    assert len(t) == 0


def test_each_summary_restarts_the_expiry_clock() -> None:
    t = table()
    for i in range(10):
        assert t.apply(summary(seq=i), A, now=i * INTERVAL).accepted
        assert t.expire(i * INTERVAL) == []
    assert t.expire(9 * INTERVAL + EXPIRY) == [A]


def test_restart_with_same_identity_is_accepted_after_expiry() -> None:
    t = table()
    t.apply(summary(seq=40), A, now=0.0)
    t.record_rtt(A, 0.010, now=0.5)
    t.note_addrs(A, ["/ip4/127.0.0.1/tcp/4001"])
    assert t.apply(summary(seq=0), A, now=EXPIRY - 0.5).reason == Verdict.STALE_SEQ
    # Old entry expired but not yet collected: a new entry, seq restarts, RTT kept.
    restarted = t.apply(summary(seq=0), A, now=EXPIRY)
    assert (restarted.accepted, restarted.reason) == (True, Verdict.NEW_PEER)
    view = t.get(A, now=EXPIRY)
    assert view is not None and view.rtt_s == 0.010
    assert view.addrs == ("/ip4/127.0.0.1/tcp/4001",)
    assert t.expire(EXPIRY) == []  # it is back, not expired
    # And after expiry was collected:
    assert t.expire(2 * EXPIRY) == [A]
    assert t.apply(summary(seq=0), A, now=2 * EXPIRY).reason == Verdict.NEW_PEER


def test_forwards_counted_until_the_next_summary() -> None:
    t = table()
    t.apply(summary(seq=1), A, now=0.0)
    t.record_forward(A, 100, now=0.1)
    t.record_forward(A, 250, now=0.2)
    assert t.record_forward(B, 999, now=0.2) is None  # unknown peer: ignored
    view = t.get(A, now=0.3)
    assert view is not None
    assert (view.forwards_since_summary, view.forwarded_prompt_tokens) == (2, 350)
    t.apply(summary(seq=1), A, now=0.4)  # rejected duplicate: no reset
    assert t.get(A, now=0.4).forwards_since_summary == 2  # type: ignore[union-attr]
    t.apply(summary(seq=2), A, now=2.0)
    view = t.get(A, now=2.0)
    assert view is not None
    assert (view.forwards_since_summary, view.forwarded_prompt_tokens) == (0, 0)
    with pytest.raises(ValueError):
        t.record_forward(A, -1, now=2.0)


def test_forwards_given_back_as_they_progress() -> None:
    t = table()
    t.apply(summary(seq=1), A, now=0.0)
    first = t.record_forward(A, 100, now=0.1)
    second = t.record_forward(A, 250, now=0.2)
    assert first is not None and second is not None

    def load() -> tuple[int, int]:
        view = t.get(A, now=0.5)
        assert view is not None
        return view.forwards_since_summary, view.forwarded_prompt_tokens

    assert load() == (2, 350)
    t.forward_prefilled(first)  # its first token came back: no longer queued there
    assert load() == (2, 250)
    t.forward_ended(first, prefilled=True)
    assert load() == (1, 250)
    # A newer summary reports the load itself: the second forward's end is not
    # subtracted from it.
    t.apply(summary(seq=2), A, now=1.0)
    third = t.record_forward(A, 40, now=1.1)
    assert load() == (1, 40)
    t.forward_ended(second, prefilled=False)
    assert load() == (1, 40)
    t.forward_ended(third, prefilled=False)  # failed before its first token: all of it back
    assert load() == (0, 0)
    t.forward_ended(third, prefilled=False)  # a double give-back cannot go below zero
    assert load() == (0, 0)


def test_rtt_is_the_least_of_a_window() -> None:
    t = table()
    assert t.record_rtt(A, 0.010, now=0.0) is False  # unknown peer: not kept
    t.apply(summary(), A, now=0.0)
    assert t.get(A, now=0.0).rtt_s is None  # type: ignore[union-attr]
    assert t.record_rtt(A, 0.020, now=0.1) is True
    t.record_rtt(A, 0.002, now=0.2)
    for i in range(RTT_WINDOW - 1):  # late pings (a busy peer) do not raise the estimate
        t.record_rtt(A, 0.050 + i, now=0.3)
    assert t.get(A, now=0.3).rtt_s == 0.002  # type: ignore[union-attr]
    t.record_rtt(A, 0.030, now=0.4)  # 0.002 left the window: the path got slower
    assert t.get(A, now=0.4).rtt_s == 0.030  # type: ignore[union-attr]
    t.apply(summary(seq=2), A, now=0.5)  # a new summary keeps what was measured
    assert t.get(A, now=0.5).rtt_s == 0.030  # type: ignore[union-attr]
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            t.record_rtt(A, bad, now=2.0)


def test_note_addrs_is_bounded() -> None:
    t = table()
    t.apply(summary(), A, now=0.0)
    t.note_addrs(A, ["junk", "/x" * 200, *(f"/ip4/10.0.0.{i}/tcp/1" for i in range(40))])
    view = t.get(A, now=0.0)
    assert view is not None and len(view.addrs) == 16
    assert all(a.startswith("/ip4/") for a in view.addrs)


def test_table_is_bounded_and_frees_slots_of_silent_peers() -> None:
    t = table()
    for i in range(MAX_PEERS):
        peer = f"Peer{i}"
        assert t.apply(summary(peer_id=peer), peer, now=float(i) * 0.001, reachable=True).accepted
    full = t.apply(summary(peer_id="Late"), "Late", now=1.0, reachable=True)
    assert (full.accepted, full.reason) == (False, Verdict.TABLE_FULL)
    assert t.apply(summary(peer_id="Peer0", seq=2), "Peer0", now=1.0).accepted  # known: fine
    later = EXPIRY + 0.0005  # Peer0 refreshed; Peer1 (t=0.001) not yet stale, the rest not
    late = t.apply(summary(peer_id="Late"), "Late", now=later, reachable=True)
    assert late.reason == Verdict.TABLE_FULL
    later = EXPIRY + 0.0015  # Peer1 is stale now: its slot is reused
    assert t.apply(summary(peer_id="Late"), "Late", now=later, reachable=True).accepted
    assert len(t) <= MAX_PEERS
    assert "Peer1" in t.expire(later)  # reported even though apply() dropped it


def test_remove() -> None:
    t = table()
    t.apply(summary(), A, now=0.0)
    t.remove(A)
    t.remove(A)
    assert t.views(now=0.0) == []
    assert t.estimate_match(A, [1, 2]) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64, unique=True),
    st.lists(st.integers(0, 64), min_size=1, max_size=5),
    st.randoms(use_true_random=False),
)
def test_estimate_match_vs_ground_truth(
    chain: list[int], depths: list[int], rng: random.Random
) -> None:
    t = table()
    truth = {}
    for i, depth in enumerate(depths):
        depth = min(depth, len(chain))
        others = [rng.getrandbits(64) for _ in range(rng.randrange(0, 100))]
        keys = list(dict.fromkeys(chain[:depth] + others))
        peer = f"Peer{i}"
        assert t.apply(summary(peer_id=peer, keys=keys, capacity=200), peer, now=0.0).accepted
        truth[peer] = depth
    probes = t.probes(chain)
    estimates = t.estimate_matches(chain, now=1.0)
    for peer, depth in truth.items():
        got = t.estimate_match(peer, probes)
        assert got == t.estimate_match(peer, chain) == estimates[peer]
        assert got >= depth  # never below the truth: no false negatives
        bloom = BloomFilter.from_bytes(  # and exactly the first Bloom miss
            t.get(peer, now=1.0).summary.bloom_bits,  # type: ignore[union-attr]
            t.get(peer, now=1.0).summary.bloom_hashes,  # type: ignore[union-attr]
            t.get(peer, now=1.0).summary.bloom,  # type: ignore[union-attr]
        )
        assert got == next((i for i, key in enumerate(chain) if key not in bloom), len(chain))


def test_estimates_rarely_exceed_truth() -> None:
    rng = random.Random(11)
    t = table()
    chain = [rng.getrandbits(64) for _ in range(64)]
    over = 0
    for i in range(50):
        keys = chain[:i] + [rng.getrandbits(64) for _ in range(150)]
        t.apply(summary(peer_id=f"Peer{i}", keys=keys), f"Peer{i}", now=0.0)
        over += t.estimate_match(f"Peer{i}", chain) > i
    assert over <= 5  # ~1% false positive per probe: an overestimate is rare


def test_misuse_raises_value_error() -> None:
    with pytest.raises(ValueError):
        PeerTable(self_id=SELF, model_id=MODEL, block_size=16, expiry_s=0.0)
    with pytest.raises(ValueError):
        table().apply(summary(), A, now=float("nan"))


@settings(max_examples=40, deadline=None)
@given(
    chain=st.lists(st.integers(0, 2**64 - 1), max_size=40),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["apply", "apply", "apply", "remove", "expire"]),
            st.integers(0, 5),  # peer
            st.integers(0, 40),  # blocks of the chain it holds
            st.sampled_from([60, 200, 3000]),  # capacity: filters of several shapes
            st.floats(0.0, 2.0),  # time step
        ),
        max_size=30,
    ),
    rng=st.randoms(use_true_random=False),
    bank_bytes=st.sampled_from([MAX_BANK_BYTES, 150_000, 0]),  # some or all peers unbanked
)
def test_routing_rows_equal_views_and_the_per_peer_walk(
    chain: list[int],
    ops: list[tuple[str, int, int, int, float]],
    rng: random.Random,
    bank_bytes: int,
) -> None:
    t = PeerTable(self_id=SELF, model_id=MODEL, block_size=16, expiry_s=EXPIRY,
                  max_bank_bytes=bank_bytes)
    now = 0.0
    seqs = [0] * 6
    for op, i, depth, capacity, step in ops:
        now += step
        peer = f"Peer{i}"
        if op == "apply":
            seqs[i] += 1
            others = [rng.getrandbits(64) for _ in range(rng.randrange(0, capacity))]
            keys = list(dict.fromkeys(chain[:depth] + others))
            s = summary(peer_id=peer, seq=seqs[i], keys=keys, capacity=capacity)
            t.apply(s, peer, now=now)
        elif op == "remove":
            t.remove(peer)
        else:
            t.expire(now)
        for probe_now in (now, now + EXPIRY / 2):
            rows = t.routing_rows(chain, probe_now)
            views = t.views(probe_now)
            assert [r.peer_id for r in rows] == [v.peer_id for v in views]
            for row, view in zip(rows, views, strict=True):
                assert row.summary is view.summary and row.rtt_s == view.rtt_s
                assert row.forwards_since_summary == view.forwards_since_summary
                assert row.forwarded_prompt_tokens == view.forwarded_prompt_tokens
                assert row.match_blocks == t.estimate_match(row.peer_id, chain)
                walk = view.summary.bloom_filter()  # and exactly the first Bloom miss
                assert row.match_blocks == next(
                    (n for n, key in enumerate(chain) if key not in walk), len(chain)
                )
            assert t.estimate_matches(chain, probe_now) == {
                r.peer_id: r.match_blocks for r in rows
            }
            assert all(r.match_blocks == 0 for r in t.routing_rows(None, probe_now))
