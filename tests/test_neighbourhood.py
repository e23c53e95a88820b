"""Gossip mode ring: the neighbourhood core, its topics, and the properties of anti-entropy
over it (no false negatives for what a peer was told; convergence after message loss)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.config import GossipMode, PeerConfig
from peer.engine.cache_only import CacheOnlyEngine
from peer.engine.radix import RadixCache
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.gossip import Gossip
from peer.swarm.neighbourhood import Neighbourhood, ring_position
from peer.swarm.peer_table import PeerTable
from peer.swarm.publish_policy import PublishPolicy
from protocols.blocks import BlockHasher
from protocols.ids import gossip_topic, ring_topic, ring_topic_owner
from protocols.summary import CacheSummary, encode_summary
from tests.test_publish_policy import _FakePubsub

MODEL = "smollm2-135m"
ids_strategy = st.lists(
    st.text("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz", min_size=4, max_size=12),
    min_size=1,
    max_size=60,
    unique=True,
)


@settings(max_examples=80, deadline=None)
@given(ids_strategy, st.integers(1, 16).map(lambda k: 2 * k), st.randoms())
def test_ring_neighbourhoods_are_symmetric_and_bounded(
    ids: list[str], size: int, rnd: random.Random
) -> None:
    hoods = {}
    for p in ids:
        shuffled = ids * 2  # duplicates and order do not matter
        rnd.shuffle(shuffled)
        hoods[p] = Neighbourhood(p, size).select(shuffled)
        assert p not in hoods[p]
        assert len(hoods[p]) == min(size, len(ids) - 1)
    for a in ids:
        for b in hoods[a]:
            assert a in hoods[b]  # symmetric: who we hear also hears us
    audience = {p: sum(p in h for h in hoods.values()) for p in ids}
    assert max(audience.values(), default=0) <= size  # nobody is heard by more than size


def test_neighbours_are_the_nearest_on_the_ring_and_update_reports_changes() -> None:
    ids = [f"peer{i}" for i in range(20)]
    hood = Neighbourhood("peer0", 4)
    first = hood.update(ids[:10])
    assert set(first.added) == hood.members and first.removed == ()
    me = ring_position("peer0")
    after = sorted(ids[1:10], key=lambda p: (ring_position(p) - me) % (1 << 64))
    assert hood.members == {*after[:2], *after[-2:]}
    change = hood.update(ids)
    assert set(change.added) == hood.members - set(first.added)
    assert set(change.removed) == set(first.added) - hood.members
    with pytest.raises(ValueError):
        Neighbourhood("peer0", 0)
    with pytest.raises(ValueError):
        PeerConfig(gossip_neighbours=3, identity_file=None)  # odd: not symmetric


def test_ring_topics_are_versioned_and_name_their_owner() -> None:
    topic = ring_topic(MODEL, "12D3KooWabc")
    assert topic.startswith("/prefixswarm/summary/2/")
    assert ring_topic_owner(topic, MODEL) == "12D3KooWabc"
    assert ring_topic_owner(gossip_topic(MODEL), MODEL) is None  # version 1: the swarm's
    assert ring_topic_owner(topic, "other-model") is None
    assert ring_topic_owner(topic + "/x", MODEL) is None
    with pytest.raises(ValueError):
        ring_topic(MODEL, "not/an/id")


# -- properties of anti-entropy over the pure cores --------------------------------------


def _summary(peer_id: str, seq: int, cache: RadixCache[None]) -> CacheSummary:
    """What peer/swarm/gossip.py publishes for `cache` (the filter by the live sizing)."""
    bloom = summary_bloom(cache.num_blocks, 0.01)
    bloom.update(cache.cached_hashes())
    return CacheSummary(peer_id=peer_id, model_id=MODEL, block_size=16, seq=seq,
                        bloom_bits=bloom.num_bits, bloom_hashes=bloom.num_hashes,
                        bloom=bloom.to_bytes(), cached_blocks=cache.num_blocks,
                        capacity_blocks=cache.capacity_blocks, queued_prompt_tokens=0,
                        running_requests=0, prefill_tokens_per_s=500.0,
                        decode_tokens_per_s=20.0)  # fmt: skip


def _insert(cache: RadixCache[None], tokens: tuple[int, ...], now: float) -> None:
    need = cache.num_blocks + len(tokens) // 16 - cache.capacity_blocks
    if need > 0:
        cache.evict(need)
    cache.insert(tokens, lambda _b: None, now)


prompts = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 10**6)), min_size=1,
    max_size=40,
)  # (shared prefix id, blocks, seed of the rest)


def _tokens(prefix: int, blocks: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    head = tuple(range(prefix * 100, prefix * 100 + 32))
    return head + tuple(rng.randrange(49152) for _ in range(16 * blocks))


@settings(max_examples=40, deadline=None)
@given(prompts, st.integers(8, 64))
def test_no_false_negatives_for_what_a_peer_was_told(
    inserts: list[tuple[int, int, int]], capacity: int
) -> None:
    """Every prompt whose blocks the sender had cached when it published matches at
    least that far in the receiver's table (Bloom filters have no false negatives)."""
    hasher = BlockHasher(MODEL, 16)
    cache: RadixCache[None] = RadixCache(16, capacity, hasher)
    for i, (prefix, blocks, seed) in enumerate(inserts):
        _insert(cache, _tokens(prefix, blocks, seed), float(i))
    cache.drain_events()
    table = PeerTable("receiver", MODEL, 16, expiry_s=6.0)
    assert table.apply(_summary("sender", 1, cache), "sender", 0.0).accepted
    for prefix, blocks, seed in inserts:
        tokens = _tokens(prefix, blocks, seed)
        cached_blocks = cache.peek(tokens) // 16
        chain = hasher.chain(list(tokens))
        assert table.estimate_match("sender", chain) >= cached_blocks


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.05, 3.0), prompts.map(lambda p: p[:3])), min_size=1,
             max_size=12),
    st.lists(st.booleans(), min_size=1, max_size=64),
    st.integers(0, 3),
)  # fmt: skip
def test_anti_entropy_converges_after_message_loss(
    changes: list[tuple[float, list[tuple[int, int, int]]]], lost: list[bool], burst: int
) -> None:
    """Summaries driven by the PublishPolicy, any of them lost before the last cache
    change and the first `burst` after it (the worst case for `burst` losses in a row):
    burst + 1 intervals after the last change the receiver holds exactly the sender's
    filter. (It fails if the policy stops republishing an unchanged cache.)"""
    interval = 2.0
    hasher = BlockHasher(MODEL, 16)
    cache: RadixCache[None] = RadixCache(16, 48, hasher)
    policy = PublishPolicy(interval)
    table = PeerTable("receiver", MODEL, 16, expiry_s=3 * interval * (burst + 2))
    losses = iter(lost)
    timeline, at = [], 0.0
    for dt, batch in changes:
        at += dt
        timeline.append((at, batch))
    last_change = at
    end = last_change + (burst + 1) * interval
    now, seq, after = 0.0, 0, 0
    while now <= end + 1e-9:
        while timeline and timeline[0][0] <= now:
            t, batch = timeline.pop(0)
            for prefix, blocks, s in batch:
                _insert(cache, _tokens(prefix, blocks, s), t)
            policy.observe(cache.drain_events(), cache.num_blocks)
        if policy.poll(now) is not None:
            seq += 1
            if now >= last_change:
                drop = after < burst
                after += 1
            else:
                drop = next(losses, False)
            if not drop:
                assert table.apply(_summary("sender", seq, cache), "sender", now).accepted
        now = min(policy.next_deadline(), timeline[0][0] if timeline else math.inf)
    view = table.get("sender", end)
    assert view is not None
    assert view.summary.bloom == _summary("sender", seq, cache).bloom
    assert view.summary.cached_blocks == cache.num_blocks


# -- the shell in ring mode ---------------------------------------------------------------


def _id() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


class _Msg:
    def __init__(self, source: ID, data: bytes) -> None:
        self.from_id = source.to_bytes()
        self.data = data


async def test_ring_shell_listens_to_its_neighbours_and_understands_version_1(
    autojump_clock: Any,
) -> None:
    engine = CacheOnlyEngine()
    me = _id()
    others = [_id() for _ in range(6)]
    table = PeerTable(me.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0)
    pubsub = _FakePubsub()
    legacy = _id()
    pubsub.peers = {p: object() for p in [*others, legacy]}
    for p in others:  # ring peers announce their own ring topic; `legacy` does not
        pubsub.peer_topics[ring_topic(engine.model_id, p.to_base58())] = {p}
    gossip = Gossip(pubsub, table, engine, peer_id=me, interval_s=2.0,  # type: ignore[arg-type]
                    fp_rate=0.01, mode=GossipMode.RING, neighbours=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(gossip.run)
        await trio.sleep(0.1)
        expected = Neighbourhood(me.to_base58(), 2).select(p.to_base58() for p in others)
        assert gossip.neighbours == expected  # the version-1 peer takes no ring place
        assert legacy.to_base58() not in gossip.neighbours
        mine = ring_topic(engine.model_id, me.to_base58())
        assert {t for _, t, _ in pubsub.published} == {mine}  # only on our own topic
        v1 = gossip_topic(engine.model_id)
        assert pubsub.subscribed == {v1, mine, *(ring_topic(engine.model_id, p)
                                                 for p in expected)}  # fmt: skip
        cache: RadixCache[None] = RadixCache(16, 64, BlockHasher(engine.model_id, 16))

        def summary(source: ID, seq: int) -> bytes:
            s = _summary(source.to_base58(), seq, cache)
            s = CacheSummary(**{**s.__dict__, "model_id": engine.model_id})
            return encode_summary(s)

        neighbour = next(p for p in others if p.to_base58() in expected)
        stranger = next(p for p in others if p.to_base58() not in expected)
        topic = ring_topic(engine.model_id, neighbour.to_base58())
        assert pubsub.validators[topic](neighbour, _Msg(neighbour, summary(neighbour, 1)))
        # someone else publishing on the neighbour's topic is refused
        assert not pubsub.validators[topic](stranger, _Msg(stranger, summary(stranger, 1)))
        assert gossip.statistics()["rejected"] == {"wrong_topic": 1}
        # a version-1 peer (full mode, on the swarm's topic) is understood
        assert pubsub.validators[v1](stranger, _Msg(stranger, summary(stranger, 2)))
        known = {v.peer_id for v in table.views(trio.current_time())}
        assert known == {neighbour.to_base58(), stranger.to_base58()}
        # the neighbourhood follows the peers we know: a neighbour leaving is forgotten
        del pubsub.peers[neighbour]
        await trio.sleep(2.0)
        assert neighbour.to_base58() not in gossip.neighbours
        assert topic not in pubsub.subscribed and topic not in pubsub.validators
        assert table.get(neighbour.to_base58(), trio.current_time()) is None
        nursery.cancel_scope.cancel()


def test_simulated_ring_receipts_do_not_grow_with_the_swarm() -> None:
    """Full flooding: each peer receives ~N summaries per interval; ring: about its
    neighbours' and interests', whatever N. Every request still completes once."""
    import dataclasses

    from bench.sim.model import simulate
    from bench.sim.params import SimParams
    from tests.test_simulate import workload

    wl = workload(400, rate=8.0)
    rates = {}
    for mode in ("full", "ring"):
        for n in (6, 24):
            params = SimParams(peers=n, capacity_blocks=128, seed=3, gossip_mode=mode,
                               gossip_neighbours=2, gossip_interest=2)
            result = simulate(params, wl)
            assert result.completions == [1] * len(wl)
            rates[(mode, n)] = result.metrics["gossip_messages_per_s_per_peer"]
            if mode == "ring":
                assert result.metrics["gossip_neighbours_mean"] <= 2 + 2
    assert rates[("full", 24)] > 3 * rates[("full", 6)]
    assert rates[("ring", 24)] < 1.5 * rates[("ring", 6)]
    assert rates[("ring", 24)] < rates[("full", 24)] / 3
    with pytest.raises(ValueError):
        dataclasses.replace(SimParams(), gossip_mode="flood")


def test_scale_checks_compare_like_with_like() -> None:
    from bench.sim.checks import scale_checks

    def row(mode: str, n: int, requests: int, msgs: float, hit: float) -> dict[str, Any]:
        return {"experiment": "scale", "policy": "cost", "gossip_mode": mode, "peers": n,
                "requests": requests, "gossip_messages_per_s_per_peer": msgs,
                "gossip_bytes_per_s_per_peer": 1000 * msgs, "hit_ratio": hit,
                "ttft_mean_s": 1.0}  # fmt: skip

    rows = [
        row("full", 64, 4608, 34.0, 0.87), row("ring", 64, 4608, 8.0, 0.85),
        row("full", 1024, 18432, 550.0, 0.88), row("ring", 1024, 18432, 9.0, 0.86),
        row("ring", 1024, 73728, 8.8, 0.87),
    ]  # fmt: skip
    checks = scale_checks(rows)
    assert (checks["peers"], checks["requests"]) == (1024, 18432)  # the pair both ran
    assert checks["gossip_messages_per_s_per_peer_of_full"] == pytest.approx(9.0 / 550.0)
    assert checks["hit_ratio_of_full"] == pytest.approx(0.86 / 0.88)
    # growth: ring's longest runs, 64 -> 1024
    assert checks["gossip_messages_per_s_per_peer_growth_64_to_1024"] == pytest.approx(8.8 / 8.0)
    assert scale_checks(rows[1:2]) == {}
