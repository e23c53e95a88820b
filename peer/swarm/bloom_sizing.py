"""Pure: the shape of the Bloom filter a peer publishes for its cache.

Shared by peer/swarm/gossip.py (the live publisher) and the benchmarks (bench/router.py), so
both size filters the same way without importing trio or libp2p.
"""

from __future__ import annotations

import functools
import math

from protocols.bloom import BloomFilter

# Summaries stay far below yamux's 256 KiB stream window: py-libp2p lets concurrent
# writes on one stream interleave once a message outgrows the window, which corrupts
# pubsub RPCs (seen with 160 KB summaries; libp2p_fixes' WORKAROUND(pubsub-decode)).
MAX_SUMMARY_BLOOM_BYTES = 48 * 1024  # 32k blocks at ~1%: 22x what 1 GiB holds for SmolLM2
MIN_BLOOM_CAPACITY = 1024  # blocks; a small cache gets a ~1.2 KiB filter


def bloom_capacity(cached_blocks: int, fp_rate: float) -> int:
    """Entries to size this peer's filter for: what is cached now, not the capacity.

    Rounded up to a power of two (at least MIN_BLOOM_CAPACITY) so the size changes
    rarely, and cut so the filter stays within MAX_SUMMARY_BLOOM_BYTES: a cache larger
    than that is summarised with a higher false-positive rate, never a larger message.
    """
    capacity = max(MIN_BLOOM_CAPACITY, 1 << max(0, cached_blocks - 1).bit_length())
    while (
        capacity > MIN_BLOOM_CAPACITY and _shape(capacity, fp_rate)[0] > MAX_SUMMARY_BLOOM_BYTES * 8
    ):
        capacity //= 2
    return capacity


@functools.lru_cache(maxsize=64)  # capacities are powers of two: a handful of keys
def _shape(capacity: int, fp_rate: float) -> tuple[int, int]:
    """(num_bits, num_hashes) of BloomFilter.for_capacity, which costs ~6 ms to plan."""
    bloom = BloomFilter.for_capacity(capacity, fp_rate)
    return bloom.num_bits, bloom.num_hashes


def summary_bloom(cached_blocks: int, fp_rate: float) -> BloomFilter:
    """An empty filter for `cached_blocks` entries within the size bound.

    When the bound cuts the size, fewer hash functions keep the filter about half full:
    its false-positive rate rises, but receivers never reject it as too full."""
    capacity = bloom_capacity(cached_blocks, fp_rate)
    num_bits, num_hashes = _shape(capacity, fp_rate)
    if cached_blocks > capacity:
        best = round(num_bits / cached_blocks * math.log(2))
        num_hashes = max(1, min(num_hashes, best))
    return BloomFilter(num_bits, num_hashes)
