"""BloomFilter: no false negatives, false-positive rate as sized, wire format, fast paths."""

from __future__ import annotations

import hashlib
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.bloom import (
    BLOCK_BITS,
    MAX_BLOOM_BITS,
    MAX_BLOOM_HASHES,
    BloomFilter,
    ProbeCache,
    Probes,
)

keys64 = st.integers(min_value=0, max_value=2**64 - 1)


def measured_fp_rate(bf: BloomFilter, inserted: set[int], rng: random.Random, probes: int) -> float:
    hits = tried = 0
    while tried < probes:
        key = rng.getrandbits(64)
        if key in inserted:
            continue
        tried += 1
        hits += key in bf
    return hits / tried


@settings(max_examples=60, deadline=None)
@given(
    st.lists(keys64, max_size=300, unique=True),
    st.integers(min_value=0, max_value=2000),
    st.sampled_from([0.001, 0.01, 0.05, 0.3]),
)
def test_no_false_negatives(keys: list[int], capacity: int, fp_rate: float) -> None:
    bf = BloomFilter.for_capacity(capacity, fp_rate)
    bf.update(keys)
    assert all(key in bf for key in keys)
    assert bf.count_prefix(keys) == len(keys)
    copy = BloomFilter.from_bytes(bf.num_bits, bf.num_hashes, bf.to_bytes())
    assert copy == bf
    assert all(key in copy for key in keys)


@pytest.mark.parametrize(("capacity", "fp_rate"), [(10_000, 0.01), (3_000, 0.001), (2_000, 0.05)])
def test_false_positive_rate_within_1_5x_of_target(capacity: int, fp_rate: float) -> None:
    rng = random.Random(20260101 + capacity)
    bf = BloomFilter.for_capacity(capacity, fp_rate)
    inserted = {rng.getrandbits(64) for _ in range(capacity)}
    bf.update(inserted)
    bits_per_entry = bf.num_bits / capacity
    assert bits_per_entry <= 1.1 * 1.44 * math.log2(1 / fp_rate)  # ~4% over a classic filter
    assert bf.expected_fp_rate(capacity) <= fp_rate
    measured = measured_fp_rate(bf, inserted, rng, 100_000)
    assert fp_rate / 1.5 <= measured <= 1.5 * fp_rate, (measured, bf)
    assert abs(bf.fill_ratio() - bf.expected_fill(capacity)) < 0.01
    assert abs(bf.estimated_count() - capacity) < 0.03 * capacity


@pytest.mark.parametrize(
    "make_key",
    [
        lambda i: i,  # consecutive
        lambda i: i << 40,  # only high bits differ
        lambda i: (i * 512) % 2**64,  # same low bits
        lambda i: 2**64 - 1 - i,
    ],
    ids=["consecutive", "high-bits", "same-low-bits", "descending"],
)
def test_structured_keys_still_spread(make_key: object) -> None:
    capacity = 2_000
    bf = BloomFilter.for_capacity(capacity, 0.01)
    inserted = {make_key(i) for i in range(capacity)}  # type: ignore[operator]
    bf.update(inserted)
    assert abs(bf.fill_ratio() - bf.expected_fill(capacity)) < 0.03
    probes = [make_key(i) for i in range(capacity, capacity + 20_000)]  # type: ignore[operator]
    measured = sum(key in bf for key in probes) / len(probes)
    assert measured <= 1.5 * 0.01


def test_sizing_is_bounded_and_clamps() -> None:
    small = BloomFilter.for_capacity(0)
    assert small.num_bits == BLOCK_BITS
    assert small.expected_fp_rate(0) == 0.0
    huge = BloomFilter.for_capacity(5_000_000, 0.01)
    assert huge.num_bits == MAX_BLOOM_BITS
    assert huge.expected_fp_rate(5_000_000) > 0.01  # clamped: the target cannot be met
    for capacity in (1, 100, 10_000, 100_000):
        bf = BloomFilter.for_capacity(capacity, 0.01)
        assert bf.num_bits % BLOCK_BITS == 0
        assert 1 <= bf.num_hashes <= MAX_BLOOM_HASHES
        if capacity >= 100:
            assert 8 <= bf.num_bits / capacity <= 16


@pytest.mark.parametrize(
    ("capacity", "fp_rate"), [(-1, 0.01), (10, 0.0), (10, 0.9), (10, 1e-9), (10, float("nan"))]
)
def test_for_capacity_rejects_misuse(capacity: int, fp_rate: float) -> None:
    with pytest.raises(ValueError):
        BloomFilter.for_capacity(capacity, fp_rate)


@pytest.mark.parametrize(
    ("num_bits", "num_hashes", "length"),
    [
        (512, 3, 63),  # too short
        (512, 3, 65),  # too long
        (500, 3, 63),  # not a multiple of 512
        (0, 3, 0),
        (MAX_BLOOM_BITS + 512, 3, (MAX_BLOOM_BITS + 512) // 8),
        (512, 0, 64),
        (512, MAX_BLOOM_HASHES + 1, 64),
    ],
)
def test_from_bytes_rejects_inconsistent_input(num_bits: int, num_hashes: int, length: int) -> None:
    with pytest.raises(ValueError):
        BloomFilter.from_bytes(num_bits, num_hashes, bytes(length))


def test_keys_must_be_unsigned_64_bit() -> None:
    bf = BloomFilter(512, 3)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            bf.add(bad)
        with pytest.raises(ValueError):
            _ = bad in bf
    with pytest.raises(TypeError):
        bf.add(True)
    with pytest.raises(TypeError):
        _ = "x" in bf


def test_wire_format_is_frozen() -> None:
    # Changing the hashing or layout breaks compatibility between versions of the swarm.
    bf = BloomFilter(4096, 5)
    bf.update(range(100))
    assert hashlib.sha256(bf.to_bytes()).hexdigest()[:16] == GOLDEN_DIGEST
    one = BloomFilter(512, 3)
    one.add(12345)
    bits = int.from_bytes(one.to_bytes(), "little")
    assert 1 <= bits.bit_count() <= 3


GOLDEN_DIGEST = "949f652bae84ca71"


@settings(max_examples=40, deadline=None)
@given(st.lists(keys64, min_size=1, max_size=40, unique=True), st.data())
def test_count_prefix_equals_walk_until_first_miss(keys: list[int], data: st.DataObject) -> None:
    bf = BloomFilter(1024, 4)
    inserted = data.draw(st.integers(min_value=0, max_value=len(keys)))
    bf.update(keys[:inserted])
    bf.update(data.draw(st.lists(keys64, max_size=60)))  # unrelated keys: collisions possible
    expected = 0
    for key in keys:
        if key not in bf:
            break
        expected += 1
    assert expected >= inserted
    cache = ProbeCache(max_keys=8)
    for probes in (keys, Probes(keys), cache.probes(keys), cache.probes(keys)):
        assert bf.count_prefix(probes) == expected
    assert len(cache.statistics()) == 3
    assert cache.statistics()["entries"] <= 16


def test_one_probes_object_serves_filters_of_any_shape() -> None:
    rng = random.Random(7)
    chain = [rng.getrandbits(64) for _ in range(64)]
    probes = ProbeCache().probes(chain)
    for capacity, depth in ((10, 3), (1_000, 64), (50_000, 20), (7, 0)):
        bf = BloomFilter.for_capacity(capacity)
        bf.update(chain[:depth])
        assert bf.count_prefix(probes) >= depth
        assert bf.count_prefix(probes) == bf.count_prefix(chain)
