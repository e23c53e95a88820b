"""The summary a peer publishes: bounded in size, accepted by receivers at any cache size."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from peer.engine.api import EngineLoad
from peer.swarm.bloom_sizing import MAX_SUMMARY_BLOOM_BYTES
from peer.swarm.local_summary import build_summary
from peer.swarm.peer_table import PeerTable
from protocols.summary import encode_summary


class FakeCache:
    def __init__(self, n: int) -> None:
        rng = random.Random(n)
        self.hashes = [rng.getrandbits(64) for _ in range(n)]
        self.num_blocks = self.public_blocks = n
        self.capacity_blocks = max(n, 1)

    def cached_hashes(self) -> list[int]:
        return self.hashes


@dataclass
class FakeEngine:
    cache: FakeCache
    model_id: str = "m"
    block_size: int = 16

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0.0, 0.0)  # idle, unmeasured, does not batch


SENDER = "12D3KooWSender"


@pytest.mark.parametrize("blocks", [0, 1, 1500, 40_000, 130_000])
def test_summaries_stay_small_and_are_accepted(blocks: int) -> None:
    engine = FakeEngine(FakeCache(blocks))
    summary = build_summary(engine, peer_id=SENDER, seq=1, fp_rate=0.01)

    assert len(summary.bloom) <= MAX_SUMMARY_BLOOM_BYTES
    assert len(encode_summary(summary)) <= MAX_SUMMARY_BLOOM_BYTES + 1024
    table = PeerTable(self_id="12D3KooWMe", model_id="m", block_size=16, expiry_s=6.0)
    verdict = table.apply(summary, SENDER, now=0.0)
    assert verdict.accepted, verdict
    bloom = summary.bloom_filter()
    assert all(h in bloom for h in engine.cache.hashes[:2000])  # no false negatives
