"""The incremental Bloom core: always the filter a rebuild from the cached hashes gives."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import peer.engine.radix as radix
import peer.swarm.incremental_bloom as incremental_bloom
from peer.engine.radix import CacheEvent, EventKind, RadixCache
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.incremental_bloom import CacheFilter, IncrementalBloom
from protocols.blocks import BlockHasher
from protocols.bloom import BloomFilter

FP_RATE = 0.01


def _rebuilt(cache: RadixCache[None]) -> BloomFilter:
    bloom = summary_bloom(cache.num_blocks, FP_RATE)
    bloom.update(cache.cached_hashes())
    return bloom


# (insert or evict, how many 4-token blocks, a seed for their tokens)
_ops = st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 40)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=_ops, capacity=st.sampled_from([8, 40, 2000]), publish_every=st.integers(1, 7))
def test_cache_filter_equals_a_rebuild_over_inserts_and_evictions(
    ops: list[tuple[bool, int, int]], capacity: int, publish_every: int
) -> None:
    cache: RadixCache[None] = RadixCache(4, capacity, BlockHasher("m", 4))
    filt = CacheFilter(FP_RATE)
    for step, (insert, blocks, seed) in enumerate(ops):
        if insert:
            rng = random.Random(seed)  # few seeds: prompts share prefixes
            tokens = [rng.randrange(4) for _ in range(4)] + [rng.randrange(1000) for _ in
                                                              range(4 * blocks - 4)]
            cache.insert(tokens, lambda _block: None, float(step))
        else:
            cache.evict(blocks)
        filt.observe(cache.drain_events())
        if step % publish_every == 0:
            assert filt.current(cache).to_filter() == _rebuilt(cache)
            assert filt.current(cache).to_bytes() == _rebuilt(cache).to_bytes()
    filt.observe(cache.drain_events())
    assert filt.current(cache).to_filter() == _rebuilt(cache)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=200),
       st.sampled_from([64, 1000, 20000]))
def test_incremental_bloom_equals_a_rebuild_after_any_sequence(
    ops: list[tuple[bool, int]], capacity: int
) -> None:
    template = BloomFilter.for_capacity(capacity, FP_RATE)
    memo: dict[int, tuple[int, int]] = {}
    shared, own = IncrementalBloom(template, memo), IncrementalBloom(template)
    keys = [random.Random(i).getrandbits(64) for i in range(61)]
    present: set[int] = set()
    for add, i in ops:
        for inc in (shared, own):
            if add:
                inc.add(keys[i])
            elif keys[i] in present:
                inc.remove(keys[i])
        if add:
            present.add(keys[i])
        else:
            present.discard(keys[i])
    rebuilt = BloomFilter(template.num_bits, template.num_hashes)
    rebuilt.update(present)
    for inc in (shared, own):
        assert inc.to_bytes() == rebuilt.to_bytes()
        assert inc.to_filter() == rebuilt
        assert len(inc) == len(present)


def test_lost_events_force_a_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(radix, "MAX_PENDING_EVENTS", 16)
    monkeypatch.setattr(incremental_bloom, "MAX_PENDING_EVENTS", 16)
    cache: RadixCache[None] = RadixCache(4, 12, BlockHasher("m", 4))
    filt = CacheFilter(FP_RATE)
    cache.insert(list(range(24)), lambda _block: None, 0.0)  # 6 blocks
    filt.observe(cache.drain_events())
    assert filt.current(cache).to_filter() == _rebuilt(cache)
    for i in range(4):  # 40 stored and 34 removed events; the outbox keeps the last 16
        cache.insert([100 + i, *range(39)], lambda _block: None, 1.0 + i)
    assert cache.statistics()["events_dropped"] > 0
    filt.observe(cache.drain_events())
    assert filt.current(cache).to_filter() == _rebuilt(cache)


def test_a_removal_never_stored_forces_a_rebuild() -> None:
    cache: RadixCache[None] = RadixCache(4, 100, BlockHasher("m", 4))
    cache.insert(list(range(16)), lambda _block: None, 0.0)
    filt = CacheFilter(FP_RATE)
    filt.observe([CacheEvent(EventKind.REMOVED, 12345)])  # the cache's events were lost
    assert filt.current(cache).to_filter() == _rebuilt(cache)


def test_the_shape_follows_the_cache_size_unless_fixed() -> None:
    cache: RadixCache[None] = RadixCache(1, 5000, BlockHasher("m", 1))
    sized, fixed = CacheFilter(FP_RATE), CacheFilter(FP_RATE, shape=(1024, 3))
    small = sized.current(cache).shape
    cache.insert(list(range(3000)), lambda _block: None, 0.0)
    events = cache.drain_events()
    sized.observe(events)
    fixed.observe(events)
    assert sized.current(cache).shape != small
    assert sized.current(cache).shape == (_rebuilt(cache).num_bits, _rebuilt(cache).num_hashes)
    assert sized.current(cache).to_filter() == _rebuilt(cache)
    assert fixed.current(cache).shape == (1024, 3)
    expected = BloomFilter(1024, 3)
    expected.update(cache.cached_hashes())
    assert fixed.current(cache).to_filter() == expected
