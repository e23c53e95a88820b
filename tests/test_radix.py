"""Radix tree: brute-force match, locks, LRU leaf eviction, budget, events."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.radix import CacheEvent, EventKind, RadixCache
from protocols.blocks import BlockHasher

BS = 2


def make(capacity: int, block_size: int = BS) -> RadixCache[tuple[int, ...]]:
    return RadixCache(block_size, capacity, BlockHasher("test-model", block_size))


def prefix_value(tokens):
    """A value that names its own prefix, so tests can check which block came back."""
    return lambda b: tuple(tokens[: (b + 1) * BS])


# Small alphabet, short prompts drawn from a small pool: many shared prefixes, much eviction.
token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=12)
ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "match", "lock", "unlock", "evict"]),
        st.integers(0, 5),  # which pool prompt, which lock, or how many blocks to evict
        st.integers(0, 12),  # cut the prompt to this length
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 8), st.lists(token_lists, min_size=1, max_size=6), ops)
def test_against_brute_force(capacity, pool, operations):
    cache = make(capacity)
    hasher = cache.hasher
    alive: dict[int, tuple[()]] = {}  # hashes cached, per the events
    locks = []
    for now, (op, which, cut) in enumerate(operations):
        probe = pool[which % len(pool)][:cut]
        if op == "insert":
            result = cache.insert(probe, prefix_value(probe), float(now))
            if result.dropped_blocks == 0:  # everything fit: the whole prompt is cached now
                assert cache.peek(probe) == len(probe) // BS * BS
        elif op in ("match", "lock"):
            m = cache.match(probe, float(now))
            if op == "lock":
                cache.lock(m)
                locks.append(m)
        elif op == "unlock" and locks:
            cache.unlock(locks.pop(which % len(locks)))
        elif op == "evict":
            cache.evict(which)
        for event in cache.drain_events():
            if event.kind is EventKind.STORED:
                assert event.block_hash not in alive
                alive[event.block_hash] = ()
            else:
                del alive[event.block_hash]
        # Budget and bookkeeping.
        assert cache.num_blocks == len(alive) <= capacity
        assert set(cache.cached_hashes()) == set(alive)
        # Locked blocks are never evicted.
        for m in locks:
            assert set(m.hashes) <= set(alive)
        # Match equals the brute-force longest cached block prefix.
        chain = hasher.chain(probe)
        expect = 0
        while expect < len(chain) and chain[expect] in alive:
            expect += 1
        m = cache.match(probe, float(now))
        assert m.num_blocks == expect and m.num_tokens == expect * BS
        assert m.hashes == tuple(chain[:expect])
        assert m.values == tuple(tuple(probe[: (b + 1) * BS]) for b in range(expect))
        assert cache.peek(probe) == expect * BS
    assert cache.statistics()["locked_blocks"] == len({h for m in locks for h in m.hashes})


def test_match_is_limited_by_max_blocks_and_partial_blocks_are_ignored():
    cache = make(10)
    cache.insert([1, 2, 3, 4, 5], prefix_value([1, 2, 3, 4, 5]), 0.0)
    assert cache.num_blocks == 2
    assert cache.match([1, 2, 3, 4, 5, 6], 1.0).num_blocks == 2
    assert cache.match([1, 2, 3, 4, 5, 6], 1.0, max_blocks=1).num_blocks == 1
    assert cache.match([1, 2, 3], 1.0).num_blocks == 1
    assert cache.match([2, 2, 3, 4], 1.0).num_blocks == 0


def test_lru_evicts_least_recently_used_leaf():
    cache = make(4)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    cache.insert(a, prefix_value(a), 1.0)
    cache.insert(b, prefix_value(b), 2.0)
    cache.match(a, 3.0)  # a is now more recent than b
    result = cache.insert(c, prefix_value(c), 4.0)
    assert result.evicted_hashes == tuple(reversed(cache.hasher.chain(b)))  # leaf first
    assert cache.peek(a) == 4 and cache.peek(b) == 0 and cache.peek(c) == 4


def test_only_leaves_are_evicted_so_prefixes_stay_whole():
    cache = make(3)
    cache.insert([1, 1, 2, 2, 3, 3], prefix_value([1, 1, 2, 2, 3, 3]), 1.0)
    assert cache.evict(1) == [cache.hasher.chain([1, 1, 2, 2, 3, 3])[2]]
    assert cache.peek([1, 1, 2, 2, 3, 3]) == 4


def test_locked_blocks_survive_and_new_blocks_are_dropped_when_full():
    cache = make(2)
    a = [1, 1, 2, 2]
    cache.insert(a, prefix_value(a), 1.0)
    m = cache.match(a, 2.0)
    cache.lock(m)
    cache.lock(m)  # ref-counted
    result = cache.insert([5, 5], prefix_value([5, 5]), 3.0)
    assert result.dropped_blocks == 1 and result.stored_hashes == () and cache.peek(a) == 4
    cache.unlock(m)
    assert cache.evict(5) == []
    cache.unlock(m)
    assert len(cache.evict(5)) == 2
    with pytest.raises(ValueError, match="unlock"):
        cache.unlock(m)


def test_insert_extending_a_full_cache_keeps_its_own_prefix():
    cache = make(2)
    cache.insert([1, 1, 2, 2], prefix_value([1, 1, 2, 2]), 1.0)
    result = cache.insert([1, 1, 2, 2, 3, 3], prefix_value([1, 1, 2, 2, 3, 3]), 2.0)
    # Only the path's leaf could go, and it is the path: nothing fits.
    assert result.existing_blocks == 2 and result.dropped_blocks == 1
    assert cache.peek([1, 1, 2, 2, 3, 3]) == 4


def test_value_factory_is_called_only_for_new_blocks():
    cache = make(10)
    calls = []

    def value(b):
        calls.append(b)
        return (b,)

    cache.insert([1, 1, 2, 2], value, 0.0)
    cache.insert([1, 1, 2, 2, 3, 3, 4], value, 1.0)
    assert calls == [0, 1, 2]
    with pytest.raises(ValueError, match="values"):
        cache.insert([7, 7, 8, 8], [(0,)], 2.0)


def test_events_and_statistics():
    cache = make(1)
    h1 = cache.hasher.chain([1, 1])[0]
    h2 = cache.hasher.chain([2, 2])[0]
    cache.insert([1, 1], prefix_value([1, 1]), 0.0)
    cache.insert([2, 2], prefix_value([2, 2]), 1.0)
    assert cache.drain_events() == [
        CacheEvent(EventKind.STORED, h1),
        CacheEvent(EventKind.REMOVED, h1),
        CacheEvent(EventKind.STORED, h2),
    ]
    assert cache.drain_events() == []
    stats = cache.statistics()
    assert stats["num_blocks"] == 1 and stats["evicted_blocks"] == 1
    assert stats["inserted_blocks"] == 2 and stats["capacity_blocks"] == 1


def test_zero_capacity_caches_nothing():
    cache = make(0)
    result = cache.insert([1, 1, 2, 2], prefix_value([1, 1, 2, 2]), 0.0)
    assert result.dropped_blocks == 2 and cache.num_blocks == 0


def test_bad_construction():
    with pytest.raises(ValueError, match="block_size"):
        RadixCache(4, 10, BlockHasher("m", 2))
    with pytest.raises(ValueError, match="capacity_blocks"):
        make(-1)
