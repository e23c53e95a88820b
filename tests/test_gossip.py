"""peer.swarm.gossip without a network: the published filter equals one rebuilt from scratch."""

from __future__ import annotations

import random

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.engine.cache_only import CacheOnlyEngine
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.gossip import Gossip
from peer.swarm.local_summary import build_summary
from peer.swarm.peer_table import PeerTable


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
