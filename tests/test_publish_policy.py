"""PublishPolicy: the one copy of when to publish and how big the filter is, and that the
live gossip shell and the simulator both follow it (a test here fails if they drift)."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from bench.sim.model import Simulator
from bench.sim.params import SimParams
from peer.engine.cache_only import CacheOnlyEngine
from peer.engine.radix import CacheEvent, EventKind
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.gossip import Gossip
from peer.swarm.incremental_bloom import IncrementalBloom
from peer.swarm.peer_table import PeerTable
from peer.swarm.publish_policy import CHANGE_FRACTION, PublishPolicy, bloom_shape
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary, decode_summary
from tests.test_simulate import workload


def _events(n: int, kind: EventKind = EventKind.STORED) -> list[CacheEvent]:
    return [CacheEvent(kind, i) for i in range(n)]


def test_periodic_then_early_with_a_gap() -> None:
    policy = PublishPolicy(2.0)
    assert policy.next_deadline() == -math.inf  # never polled: poll now
    assert policy.poll(0.0) == (False, 0)
    assert policy.next_deadline() == 0.5  # the next chance of an early summary
    policy.observe(_events(5), cached_blocks=100)  # 5% of 100
    assert policy.poll(0.3) is None  # changed enough, but within the early gap
    assert policy.next_deadline() == pytest.approx(0.8)
    decision = policy.poll(0.5)
    assert decision is not None and decision.early and decision.changed_blocks == 5
    assert policy.poll(1.0) is None  # nothing changed since
    policy.observe(_events(4), cached_blocks=100)
    assert policy.poll(2.0) is None  # 4 < 5 changes, and the periodic one is due at 2.5
    decision = policy.poll(2.5)
    assert decision is not None and not decision.early
    assert policy.next_deadline() == 3.0


def test_early_publish_off_and_validation() -> None:
    policy = PublishPolicy(1.0, early_publish=False)
    policy.poll(0.0)
    policy.observe(_events(50), cached_blocks=10)
    assert policy.poll(0.9) is None
    assert policy.poll(1.0) is not None
    with pytest.raises(ValueError):
        PublishPolicy(0.0)
    with pytest.raises(ValueError):
        policy.poll(math.nan)
    with pytest.raises(ValueError):
        policy.observe([], cached_blocks=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 1.5), st.integers(0, 40)), min_size=1, max_size=40))
def test_never_silent_longer_than_an_interval(steps: list[tuple[float, int]]) -> None:
    """Driven as the shells drive it (poll at next_deadline), a summary goes out at least
    every interval and early ones never closer than the gap."""
    policy = PublishPolicy(2.0)
    now, published = 0.0, []
    for _, changes in steps:
        if policy.poll(now) is not None:
            published.append(now)
        policy.observe(_events(changes), cached_blocks=200)
        now = policy.next_deadline()
    gaps = [b - a for a, b in itertools.pairwise(published)]
    assert all(0.5 - 1e-9 <= g <= 2.0 + 1e-9 for g in gaps)
    assert CHANGE_FRACTION == 0.05


# -- the live shell follows the policy ---------------------------------------------------


class _FakePubsub:
    """What Gossip needs from py-libp2p's Pubsub, recording publishes at virtual time."""

    def __init__(self) -> None:
        self.published: list[tuple[float, str, bytes]] = []
        self.validators: dict[str, Any] = {}
        self.peers: dict[ID, object] = {}
        self.peer_topics: dict[str, set[ID]] = {}
        self.router = object()
        self.subscribed: set[str] = set()

    def set_topic_validator(self, topic: str, validator: Any, is_async: bool) -> None:
        self.validators[topic] = validator

    def remove_topic_validator(self, topic: str) -> None:
        self.validators.pop(topic, None)

    async def subscribe(self, topic: str) -> Any:
        self.subscribed.add(topic)
        send, receive = trio.open_memory_channel[object](0)
        self._keep = [*getattr(self, "_keep", []), send]
        return receive

    async def unsubscribe(self, topic: str) -> None:
        self.subscribed.discard(topic)

    async def publish(self, topic: str, data: bytes) -> None:
        self.published.append((trio.current_time(), topic, data))

    async def push_msg(self, forwarder: ID, msg: object) -> None:  # the gossip gate wraps it
        raise AssertionError("nothing is received here")


async def test_live_gossip_publishes_when_the_policy_says(autojump_clock: Any) -> None:
    """The shell's publish times equal those of a PublishPolicy fed the same cache changes
    at the same times: the live loop has no rule of its own."""
    rng = random.Random(5)
    engine = CacheOnlyEngine(capacity_blocks=400)
    peer_id = ID.from_pubkey(create_new_key_pair().public_key)
    table = PeerTable(peer_id.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0)
    pubsub = _FakePubsub()
    gossip = Gossip(
        pubsub,
        table,
        engine,
        peer_id=peer_id,
        interval_s=2.0,  # type: ignore[arg-type]
        fp_rate=0.01,
    )
    # (times off the policy's 0.5 s grid: a tie would hang on task order, not on the rule)
    inserts = [(round(rng.uniform(0.0, 12.0), 2) + 0.003, rng.randrange(1, 6)) for _ in range(25)]
    inserts.sort()
    async with trio.open_nursery() as nursery:
        await nursery.start(gossip.run)
        start = trio.current_time()
        for at, n in inserts:
            await trio.sleep_until(start + at)
            engine.insert([rng.randrange(49152) for _ in range(16 * n)])
        await trio.sleep_until(start + 13.9)
        nursery.cancel_scope.cancel()
    live = [round(t - start, 6) for t, _, _ in pubsub.published]
    # Replay: the same changes, polled at the policy's own deadlines.
    policy = PublishPolicy(2.0)
    replay: list[float] = []
    now, i, blocks = 0.0, 0, 0
    while now <= 13.9:
        while i < len(inserts) and inserts[i][0] <= now:
            blocks += inserts[i][1]
            policy.observe(_events(inserts[i][1]), cached_blocks=blocks)
            i += 1
        if policy.poll(now) is not None:
            replay.append(round(now, 6))
        now = policy.next_deadline()
    assert live == replay
    assert any(b - a < 2.0 - 1e-6 for a, b in itertools.pairwise(live))  # some early
    # and the filter is the live sizing's
    summary = decode_summary(pubsub.published[-1][2])
    assert (summary.bloom_bits, summary.bloom_hashes) == bloom_shape(summary.cached_blocks, 0.01)


# -- the simulator follows the policy and the sizing -----------------------------------


def test_simulator_publishes_by_the_policy_with_the_live_filter() -> None:
    params = SimParams(peers=4, capacity_blocks=128, seed=3)
    sim = Simulator(params, workload(200))
    seen: list[tuple[int, float, CacheSummary]] = []
    sim.on_publish = lambda idx, t, s: seen.append((idx, t, s))
    sim.run()
    assert seen
    for _, _, summary in seen:
        # the shape the live peer would publish for this many cached blocks
        live = summary_bloom(summary.cached_blocks, params.bloom_fp_rate)  # gossip.py's
        assert (summary.bloom_bits, summary.bloom_hashes) == (live.num_bits, live.num_hashes)
    # 10,240 bits for a 128-block cache, as the live peer sends (the simulator sent 2,560)
    assert seen[0][2].bloom_bits == summary_bloom(128, 0.01).num_bits == 10240
    # publish times: a PublishPolicy polled at each tick of the same peer agrees
    times = [t for idx, t, _ in seen if idx == 0]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(
        params.summary_interval_s / 4 - 1e-9 <= g <= params.summary_interval_s + 1e-9 for g in gaps
    )
    for peer in sim.peers:  # the simulator's decisions are the policy object's own
        assert isinstance(peer.publish_policy, PublishPolicy)
        assert peer.publish_policy.last_publish == max(t for i, t, _ in seen if i == peer.idx)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**63), min_size=0, max_size=300, unique=True))
def test_simulator_filter_bytes_equal_the_live_filter(keys: list[int]) -> None:
    shape = bloom_shape(len(keys), 0.01)
    incremental = IncrementalBloom(BloomFilter(*shape))
    for key in keys:
        incremental.add(key)
    live = summary_bloom(len(keys), 0.01)
    live.update(keys)
    assert incremental.to_bytes() == live.to_bytes()
