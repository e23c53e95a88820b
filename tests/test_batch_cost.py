"""The cost model of a batching peer (peer/routing/cost.py): marginal slowdown, not a share."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.cost import (
    BATCH_STEP_SLOPE,
    LocalState,
    PeerEstimate,
    batch_share,
    estimate_cost,
    rank_estimates,
    single_stream_decode,
    swarm_busy,
)
from peer.routing.router import Router
from peer.swarm.peer_table import PeerTable
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary, decode_summary, encode_summary

PROMPT, NEW = 1024, 32
prompts = st.integers(1, 4096)
news = st.integers(1, 512)
speeds = st.floats(1.0, 1e5)
slots = st.integers(1, 256)


@given(
    st.integers(0, 600), slots, st.integers(0, 4096), prompts, news, st.integers(0, 10**6),
    speeds, speeds,
)
def test_pricing_is_monotone_in_the_batch(
    running: int, batch_slots: int, step_tokens: int, prompt: int, new: int, queued: int,
    prefill: float, decode: float,
) -> None:
    """One more request in a batching peer's batch (or queue) never makes it cheaper."""
    match = prompt // 2

    def cost(r: int) -> float:
        return estimate_cost(
            match, prompt, new, queued, r, prefill, decode, 0.01,
            batch_slots=batch_slots, step_tokens=step_tokens,
        ).total_s

    assert cost(running) <= cost(running + 1)
    assert batch_share(running, batch_slots) <= batch_share(running + 1, batch_slots)


@given(
    st.integers(1, 255), st.just(0) | st.integers(512, 8192), prompts, st.integers(4, 512),
    speeds, speeds,
)
def test_a_free_slot_is_cheaper_than_a_processor_sharing_share(
    running: int, step_tokens: int, prompt: int, new: int, prefill: float, decode: float
) -> None:
    """With a free slot, joining a batch of r costs 2 * slope * r lone decodes plus the batch's
    part of the prefill steps; processor sharing would charge r whole decodes. (Step budgets
    of at least twice the batch: the engine's are 256 tokens for 32 sequences; with a budget
    of one token a prompt would take as many steps as it has tokens.)"""
    batch_slots = running + 1
    ps = estimate_cost(0, prompt, new, 0, running, prefill, decode, 0.0)
    batched = estimate_cost(
        0, prompt, new, 0, running, prefill, decode, 0.0,
        batch_slots=batch_slots, step_tokens=step_tokens,
    )
    assert batched.queue_s < ps.queue_s
    assert batched.total_s < ps.total_s
    assert (batched.network_s, batched.prefill_s, batched.decode_s) == (
        ps.network_s, ps.prefill_s, ps.decode_s
    )


def test_batch_share_by_hand() -> None:
    s = BATCH_STEP_SLOPE
    assert batch_share(5, 0) == 5.0  # processor sharing: an old summary, a peer that does not batch
    assert batch_share(0, 8) == 0.0
    assert batch_share(3, 8) == pytest.approx(2 * s * 3)
    # 8 running in 8 slots: a full batch, and we are the first to wait for a slot, which
    # frees after about one request's decode at a full batch per 8 requests ahead.
    assert batch_share(8, 8) == pytest.approx(2 * s * 8 + 1 / 8 * (1 - s + 8 * s))
    assert batch_share(15, 8) == pytest.approx(2 * s * 8 + 8 / 8 * (1 - s + 8 * s))


def test_prefill_chunks_ride_the_batch_steps() -> None:
    """A 1000-token miss on a peer stepping 256 tokens with 6 decoding: 4 chunks of 250, each
    in a step that also decodes the 6 (6 * slope of a lone step longer)."""
    base = estimate_cost(24, 1024, NEW, 0, 6, 500.0, 10.0, 0.0, batch_slots=32)
    chunked = estimate_cost(24, 1024, NEW, 0, 6, 500.0, 10.0, 0.0, batch_slots=32, step_tokens=256)
    assert chunked.queue_s - base.queue_s == pytest.approx(4 * BATCH_STEP_SLOPE * 6 / 10.0)


def test_single_stream_decode_undoes_the_batch() -> None:
    s = BATCH_STEP_SLOPE
    # One stream at 8 tokens/s while the batch made 64: measured at a batch of 8.
    assert single_stream_decode(8.0, 64.0) == pytest.approx(8.0 * (1 - s + 8 * s))
    assert single_stream_decode(8.0, 0.0) == 8.0  # batch speed unknown (a version 1 summary)
    assert single_stream_decode(8.0, 8.0) == 8.0  # measured alone
    assert single_stream_decode(0.0, 64.0) == 0.0  # not measured: the priors apply later


def test_ranked_costs_are_estimate_cost_for_batching_peers_too() -> None:
    """The ranking loop prices with estimate_cost itself: the formula exists once."""
    rng = random.Random(3)
    estimates = [
        PeerEstimate(
            f"p{i}", i == 0, rng.randrange(64), 0, rng.randrange(2000), rng.randrange(40),
            rng.uniform(100, 5000), rng.uniform(5, 50), 0.0 if i == 0 else rng.uniform(0, 0.1),
            batch_slots=rng.choice([0, 8, 32]), step_tokens=rng.choice([0, 256]),
        )
        for i in range(12)
    ]
    estimates = [e._replace(match_tokens=e.match_blocks * 16) for e in estimates]
    busy = swarm_busy(estimates)
    best = max(e.match_tokens for e in estimates)
    for c in rank_estimates(Policy.COST, estimates, PROMPT, NEW, rng):
        e = c.estimate
        expected = estimate_cost(
            e.match_tokens, PROMPT, NEW, e.queued_prompt_tokens, e.running_requests,
            e.prefill_tokens_per_s, e.decode_tokens_per_s, e.rtt_s, busy, best,
            e.batch_slots, e.step_tokens,
        )
        assert c.cost_s == expected.total_s
        assert c.queue_s == expected.queue_s
        assert c.cost.queue_s == expected.queue_s


def _summary(peer_id: str, **batch: object) -> CacheSummary:
    bloom = BloomFilter.for_capacity(64)
    return CacheSummary(
        peer_id=peer_id, model_id="smollm2-135m", block_size=16, seq=1,
        bloom_bits=bloom.num_bits, bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(),
        cached_blocks=0, capacity_blocks=64, queued_prompt_tokens=0, running_requests=6,
        prefill_tokens_per_s=500.0, decode_tokens_per_s=8.0, **batch,  # type: ignore[arg-type]
    )


def test_router_prices_a_batching_summary_by_its_batch_and_an_old_one_as_before() -> None:
    """Two remote peers with the same load and per-stream speed: the one whose (version 2)
    summary says it batches 6 streams in 32 slots is cheaper, and its lone-stream speed is
    recovered from the batch speed; the version 1 one is priced as processor sharing."""
    table = PeerTable("self", "smollm2-135m", 16, 10.0)
    old = decode_summary(encode_summary(_summary("old")))
    new = decode_summary(encode_summary(_summary(
        "new", waiting_requests=0, batch_slots=32, batch_decode_tokens_per_s=48.0,
        step_tokens=256,
    )))
    assert old.batch_slots == 0 and new.batch_slots == 32
    for s in (old, new):
        assert table.apply(s, s.peer_id, 0.0).accepted
        table.record_rtt(s.peer_id, 0.01, 0.0)
    router = Router(Policy.COST, random.Random(0), block_size=16)
    # Ourselves: busier than both; our lone stream as fast as theirs (12.8 tokens/s).
    local = LocalState("self", 0, 0, 30, 500.0, 8.0, batch_decode_tokens_per_s=48.0)
    ranked = router.rank([], PROMPT, NEW, local, table, 0.0)
    by_id = {c.peer_id: c for c in ranked}
    assert ranked[0].peer_id == "new"
    assert by_id["old"].estimate.batch_slots == 0
    s = BATCH_STEP_SLOPE
    lone = 8.0 * (1 - s + 6 * s)  # measured at a batch of 48 / 8 = 6
    assert lone == pytest.approx(12.8)
    assert router.local_estimate(local).decode_tokens_per_s == pytest.approx(lone)
    assert by_id["new"].estimate.decode_tokens_per_s == pytest.approx(lone)
    # The old peer's 8.0 is within SPEED_NOISE_FACTOR of our 12.8: it counts as ours.
    assert by_id["old"].queue_s == pytest.approx(6 * NEW / lone)
    assert by_id["new"].queue_s == pytest.approx(
        2 * s * 6 * NEW / lone + 5 * s * 6 / lone  # 1024 tokens in chunks of 250: 5 steps
    )
    assert by_id["new"].cost_s < by_id["old"].cost_s
    assert "batches up to 32" in by_id["new"].reason


def test_a_batching_engine_load_reaches_the_summary() -> None:
    """build_summary copies the engine's batch figures; a peer that does not batch still
    publishes a version 1 summary, which peers without the batch fields can read."""
    from types import SimpleNamespace

    from peer.engine.api import EngineLoad
    from peer.engine.cache_only import CacheOnlyEngine
    from peer.swarm.local_summary import build_summary

    engine = CacheOnlyEngine("smollm2-135m")
    assert decode_summary(encode_summary(
        build_summary(engine, peer_id="me", seq=1, fp_rate=0.01)
    )).batch_slots == 0
    load = EngineLoad(100, 9, 500.0, 8.0, waiting_requests=1, batch_decode_tokens_per_s=64.0,
                      batch_slots=8, step_tokens=256)
    batching = SimpleNamespace(
        model_id=engine.model_id, block_size=engine.block_size, cache=engine.cache,
        load=lambda: load,
    )
    summary = build_summary(batching, peer_id="me", seq=2, fp_rate=0.01)  # type: ignore[arg-type]
    assert (summary.waiting_requests, summary.batch_slots, summary.step_tokens) == (1, 8, 256)
    assert summary.batch_decode_tokens_per_s == 64.0
    assert decode_summary(encode_summary(summary)) == summary
