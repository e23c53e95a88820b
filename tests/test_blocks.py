"""Block-hash chain: pinned values (identical in every process), prefix and seed properties."""

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.blocks import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, BlockHasher

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)


def test_pinned_values():
    h = BlockHasher("smollm2-135m", 16)
    assert h.seed == 14122204928996790993
    assert h.chain(list(range(40))) == [2382596783995464794, 14587938480236165518]
    h4 = BlockHasher("tiny-random", 4)
    assert h4.seed == 7735646833001647618
    assert h4.chain([1, 2, 3, 4, 5, 6, 7, 8]) == [5939426901014947627, 16924817597904821749]


def test_definition_is_blake2b_over_prev_hash_and_uint32_le():
    h = BlockHasher("m", 2)
    seed = hashlib.blake2b(b"prefixswarm/blocks/1\0m\x002", digest_size=8).digest()
    assert h.seed == int.from_bytes(seed, "little")
    first = hashlib.blake2b(seed + struct.pack("<2I", 7, 9), digest_size=8).digest()
    assert h.chain([7, 9, 1]) == [int.from_bytes(first, "little")]


def test_only_full_blocks_are_hashed():
    h = BlockHasher("m", DEFAULT_BLOCK_SIZE)
    assert h.chain([]) == []
    assert h.chain([1] * 15) == []
    assert len(h.chain([1] * 16)) == 1
    assert len(h.chain([1] * 47)) == 2


@settings(max_examples=50)
@given(tokens_st, st.integers(1, 8))
def test_chain_of_a_prefix_is_a_prefix_of_the_chain(tokens, block_size):
    h = BlockHasher("m", block_size)
    full = h.chain(tokens)
    for cut in range(len(tokens) + 1):
        assert full[: cut // block_size] == h.chain(tokens[:cut])


@settings(max_examples=50)
@given(tokens_st, st.integers(1, 8))
def test_extend_agrees_with_chain(tokens, block_size):
    h = BlockHasher("m", block_size)
    prev = None
    for b, value in enumerate(h.chain(tokens)):
        prev = h.extend(prev, tokens[b * block_size : (b + 1) * block_size])
        assert prev == value
    if len(tokens) >= block_size:  # the seed and None both mean "first block"
        assert h.extend(h.seed, tokens[:block_size]) == h.extend(None, tokens[:block_size])


def test_model_and_block_size_change_every_hash():
    tokens = list(range(64))
    a = BlockHasher("a", 16).chain(tokens)
    b = BlockHasher("b", 16).chain(tokens)
    assert not set(a) & set(b)
    c = BlockHasher("a", 8).chain(tokens)
    assert not set(a) & set(c)


def test_a_different_earlier_block_changes_later_hashes():
    h = BlockHasher("m", 4)
    a = h.chain([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.chain([1, 2, 3, 9, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_out_of_range_token_is_a_value_error(bad):
    with pytest.raises(ValueError, match="outside"):
        BlockHasher("m", 2).chain([0, bad])


def test_bad_construction():
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("m", 0)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("m", MAX_BLOCK_SIZE + 1)
    with pytest.raises(ValueError, match="model_id"):
        BlockHasher("", 16)
    with pytest.raises(ValueError, match="exactly 2"):
        BlockHasher("m", 2).extend(None, [1])
