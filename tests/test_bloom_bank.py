"""BloomBank: bit-sliced prefix counts equal each filter's own walk until the first miss."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.bloom import BLOCK_BITS, MAX_BLOOM_HASHES, BloomFilter, Probes
from protocols.bloom_bank import MAX_BANK_SLOTS, BloomBank, KeyChain

keys64 = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(keys64, max_size=40), st.integers(1, MAX_BLOOM_HASHES), st.integers(1, 8192))
def test_vectorised_mixing_equals_the_scalar_layout(
    keys: list[int], num_hashes: int, num_blocks: int
) -> None:
    rows = KeyChain(keys).rows(num_blocks, num_hashes)
    probes = Probes(keys)
    for key_rows, block, mask in zip(
        rows.tolist(), probes.indices(num_blocks), probes.masks(num_hashes), strict=True
    ):
        assert {r // BLOCK_BITS for r in key_rows} == {block}
        assert sum(1 << (r % BLOCK_BITS) for r in set(key_rows)) == mask


@settings(max_examples=40, deadline=None)
@given(
    chain=st.lists(keys64, max_size=48),
    shape=st.sampled_from([(512, 1), (1024, 4), (4096, 7), (512, 16)]),
    filters=st.lists(st.tuples(st.integers(0, 48), st.lists(keys64, max_size=80)), max_size=70),
    released=st.sets(st.integers(0, 69)),
    data=st.data(),
)
def test_prefix_counts_equal_count_prefix(
    chain: list[int],
    shape: tuple[int, int],
    filters: list[tuple[int, list[int]]],
    released: set[int],
    data: st.DataObject,
) -> None:
    bank = BloomBank(*shape)
    held: dict[int, BloomFilter] = {}
    for depth, others in filters:
        bf = BloomFilter(*shape)
        bf.update(chain[:depth])
        bf.update(others)  # unrelated keys: false positives along the chain are possible
        slot = bank.acquire()
        bank.put(slot, bf.to_bytes())
        held[slot] = bf
    for slot in released & set(held):
        bank.release(slot)
        del held[slot]
    if held and data.draw(st.booleans()):  # a deferred overwrite, then a reused slot
        slot = data.draw(st.sampled_from(sorted(held)))
        bank.put(slot, BloomFilter(*shape).to_bytes())
        held[slot] = BloomFilter(*shape)
    counts = bank.prefix_counts(KeyChain(chain))
    assert len(bank) == len(held)
    for slot in range(len(counts)):
        expected = held[slot].count_prefix(chain) if slot in held else 0
        assert counts[slot] == expected


@settings(max_examples=30, deadline=None)
@given(
    chain=st.lists(keys64, min_size=1, max_size=12),
    rounds=st.lists(
        st.lists(st.tuples(st.integers(0, 129), st.integers(0, 12), st.booleans()), max_size=90),
        min_size=1, max_size=4,
    ),
)  # fmt: skip
def test_successive_flushes_of_many_slots_keep_every_other_slot(
    chain: list[int], rounds: list[list[tuple[int, int, bool]]]
) -> None:
    """Flushes that rewrite many slots of a word at once (the batched path) and few
    (one at a time) leave every slot equal to its own filter, changed or not."""
    shape = (1024, 5)
    bank = BloomBank(*shape)
    for _ in range(130):
        bank.acquire()
    held = {slot: BloomFilter(*shape) for slot in range(130)}
    for changes in rounds:
        for slot, depth, empty in changes:
            bf = BloomFilter(*shape)
            if not empty:
                bf.update(chain[:depth])
                bf.add(slot)  # every filter differs from the others
            bank.put(slot, bf.to_bytes())
            held[slot] = bf
        counts = bank.prefix_counts(KeyChain(chain))
        for slot, bf in held.items():
            assert (counts[slot] if slot < len(counts) else 0) == bf.count_prefix(chain)


def test_slots_are_reused_and_bounded() -> None:
    bank = BloomBank(512, 3)
    slots = [bank.acquire() for _ in range(130)]
    assert slots == list(range(130))
    bank.release(5)
    bank.release(5)  # ignored
    assert bank.acquire() == 5
    chain = [random.Random(1).getrandbits(64) for _ in range(4)]
    full = BloomFilter(512, 3)
    full.update(chain)
    bank.put(129, full.to_bytes())
    counts = bank.prefix_counts(KeyChain(chain))
    assert counts[129] == 4 and sum(counts) == 4 and len(counts) >= 130
    while len(bank) < MAX_BANK_SLOTS:
        bank.acquire()
    with pytest.raises(ValueError, match="at most"):
        bank.acquire()


def test_misuse_raises_value_error() -> None:
    bank = BloomBank(1024, 2)
    with pytest.raises(ValueError, match="not in use"):
        bank.put(0, bytes(128))
    slot = bank.acquire()
    with pytest.raises(ValueError, match="bytes"):
        bank.put(slot, bytes(64))
    for bad in ([-1], [2**64], [1.0], ["1"]):
        with pytest.raises(ValueError):
            KeyChain(bad)  # type: ignore[arg-type]
    for shape in ((1000, 2), (0, 2), (1024, 0), (1024, MAX_BLOOM_HASHES + 1)):
        with pytest.raises(ValueError):
            BloomBank(*shape)
