"""Pure: this peer's own cache summary, built from its engine's state.

`EngineLike` is what a summary needs from the engine (peer.engine.Engine has it; so do
bench's cache-only engines); `build_summary` is the summary the gossip shell
(peer/swarm/gossip.py) publishes and the engine's state says.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from peer.swarm.bloom_sizing import summary_bloom
from protocols.bloom import BloomFilter
from protocols.summary import CacheSummary

__all__ = ["CacheLike", "EngineLike", "LoadLike", "build_summary"]


class LoadLike(Protocol):
    @property
    def queued_prompt_tokens(self) -> int: ...
    @property
    def running_requests(self) -> int: ...
    @property
    def prefill_tokens_per_s(self) -> float: ...
    @property
    def decode_tokens_per_s(self) -> float: ...
    @property
    def waiting_requests(self) -> int: ...
    @property
    def batch_slots(self) -> int: ...
    @property
    def batch_decode_tokens_per_s(self) -> float: ...
    @property
    def step_tokens(self) -> int: ...


class CacheLike(Protocol):
    @property
    def num_blocks(self) -> int: ...
    @property
    def capacity_blocks(self) -> int: ...
    def cached_hashes(self) -> Iterable[int]: ...
    def root_hashes(self) -> list[int]: ...
    def drain_events(self) -> list[Any]: ...


class EngineLike(Protocol):
    """What gossip needs from the engine (peer.engine.Engine has it)."""

    @property
    def model_id(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def cache(self) -> CacheLike: ...
    def load(self) -> LoadLike: ...


def build_summary(
    engine: EngineLike,
    *,
    peer_id: str,
    seq: int,
    fp_rate: float,
    bloom: BloomFilter | None = None,
) -> CacheSummary:
    """This peer's summary now: a Bloom filter of every cached block hash, plus load.

    `bloom`, if given, must already hold exactly the cached hashes (see Gossip)."""
    cache = engine.cache
    if bloom is None:
        bloom = summary_bloom(cache.num_blocks, fp_rate)
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
        cached_blocks=cache.num_blocks,
        capacity_blocks=cache.capacity_blocks,
        queued_prompt_tokens=load.queued_prompt_tokens,
        running_requests=load.running_requests,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        decode_tokens_per_s=load.decode_tokens_per_s,
        waiting_requests=load.waiting_requests,
        batch_slots=load.batch_slots,
        batch_decode_tokens_per_s=load.batch_decode_tokens_per_s,
        step_tokens=load.step_tokens,
    )
