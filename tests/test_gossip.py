"""peer.swarm.gossip without a network: the published filter equals one rebuilt from scratch;
the counts of summaries published and accepted per sender."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from peer.engine.cache_only import CacheOnlyEngine
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.gossip import Gossip
from peer.swarm.local_summary import build_summary
from peer.swarm.peer_table import PeerTable
from protocols.summary import encode_summary


def _gossip(engine: CacheOnlyEngine) -> Gossip:
    peer_id = ID.from_pubkey(create_new_key_pair().public_key)
    table = PeerTable(peer_id.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0)
    return Gossip(
        None,  # type: ignore[arg-type]  # the filter path never touches pubsub
        table,
        engine,
        peer_id=peer_id,
        interval_s=2.0,
        fp_rate=0.01,
    )


def _rebuilt(engine: CacheOnlyEngine) -> object:
    bloom = summary_bloom(engine.cache.num_blocks, 0.01)
    bloom.update(engine.cache.cached_hashes())
    return bloom


@pytest.mark.parametrize("capacity_blocks", [4096, 300])  # 300: evictions force rebuilds
async def test_incremental_filter_equals_rebuilt_filter(capacity_blocks: int) -> None:
    rng = random.Random(capacity_blocks)
    engine = CacheOnlyEngine(capacity_blocks=capacity_blocks)
    gossip = _gossip(engine)
    for _round in range(12):
        for _ in range(rng.randrange(0, 30)):
            prefix = [rng.randrange(50) for _ in range(16 * rng.randrange(1, 3))]
            engine.insert(prefix + [rng.randrange(49152) for _ in range(16 * rng.randrange(1, 5))])
        assert gossip._current_bloom() == _rebuilt(engine)


async def test_summary_carries_cache_size_and_load() -> None:
    engine = CacheOnlyEngine()
    engine.insert(list(range(64)))
    summary = build_summary(engine, peer_id="12D3KooWtest", seq=7, fp_rate=0.01)
    assert (summary.seq, summary.cached_blocks, summary.capacity_blocks) == (7, 4, 1456)
    bloom = summary.bloom_filter()
    assert all(h in bloom for h in engine.hasher.chain(list(range(64))))


def _summary_from(sender: ID, seq: int, *, leaving: bool = False) -> rpc_pb2.Message:
    """What pubsub hands the validator: `sender`'s signed summary (signature not checked)."""
    summary = build_summary(
        CacheOnlyEngine(), peer_id=sender.to_base58(), seq=seq, fp_rate=0.01, leaving=leaving
    )
    return rpc_pb2.Message(from_id=sender.to_bytes(), data=encode_summary(summary))


async def test_gossip_counts_what_was_published_and_accepted_per_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gossip = _gossip(CacheOnlyEngine())
    published: list[bytes] = []

    async def publish(topic: str, data: bytes) -> None:
        published.append(data)

    gossip._pubsub = SimpleNamespace(publish=publish)  # type: ignore[assignment]
    a, b, c = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(3))
    for _ in range(3):
        await gossip._publish(early=False)
    for msg in [_summary_from(a, 1), _summary_from(a, 2), _summary_from(b, 1)]:
        assert gossip._validate(a, msg, None)
    junk = rpc_pb2.Message(from_id=c.to_bytes(), data=b"junk")
    assert not gossip._validate(a, junk, None)  # rejected: not counted
    assert gossip._validate(a, _summary_from(a, 2), None)  # a replay: relayed, not counted
    assert gossip.gossip_counts() == {
        "published": len(published),
        "accepted": {a.to_base58(): 2, b.to_base58(): 1},
    }
    # bounded by the table's size: once full, senders gone from the table are forgotten
    monkeypatch.setattr("peer.swarm.gossip.MAX_PEERS", 2)
    assert gossip._validate(a, _summary_from(a, 3, leaving=True), None)  # a leaves
    assert gossip._stats["left"] == 1
    assert gossip._validate(c, _summary_from(c, 1), None)
    assert gossip.gossip_counts()["accepted"] == {b.to_base58(): 1, c.to_base58(): 1}
