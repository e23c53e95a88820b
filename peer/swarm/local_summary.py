"""Pure: this peer's own cache summary, built from its engine's state.

`build_summary` is the summary the gossip shell (peer/swarm/gossip.py) publishes, read
from the engine's cache view (peer/engine/api.py's EngineView).
"""

from __future__ import annotations

from peer.engine.api import EngineView
from peer.swarm.bloom_sizing import summary_bloom
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary

__all__ = ["build_summary"]


def build_summary(
    engine: EngineView,
    *,
    peer_id: str,
    seq: int,
    fp_rate: float,
    bloom: BloomFilter | None = None,
    software: str = "",
    leaving: bool = False,
) -> CacheSummary:
    """This peer's summary now: a Bloom filter of every cached public block hash, plus load.

    `cached_blocks` counts exactly the blocks in the filter: private (salted) blocks are
    in neither, or receivers would find the fill too low for the count and drop this peer
    as inconsistent. `bloom`, if given, must already hold exactly the public cached
    hashes (see Gossip)."""
    cache = engine.cache
    if bloom is None:
        bloom = summary_bloom(cache.public_blocks, fp_rate)
        bloom.update(cache.cached_hashes())
    load = engine.load()
    return CacheSummary(
        peer_id=peer_id,
        model_id=engine.model_id,
        block_size=engine.block_size,
        seq=seq,
        bloom_bits=bloom.num_bits,
        bloom_hashes=bloom.num_hashes,
        bloom=bloom.to_bytes(),
        cached_blocks=cache.public_blocks,
        capacity_blocks=cache.capacity_blocks,
        queued_prompt_tokens=load.queued_prompt_tokens,
        running_requests=load.running_requests,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        decode_tokens_per_s=load.decode_tokens_per_s,
        waiting_requests=load.waiting_requests,
        batch_slots=load.batch_slots,
        batch_decode_tokens_per_s=load.batch_decode_tokens_per_s,
        step_tokens=load.step_tokens,
        software=software,
        leaving=leaving,
    )
