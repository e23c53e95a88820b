"""The fixed-order attention: attention, and the same bits for a row in any call."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.fixed_attention import (
    MIN_QUERY_ROWS,
    fixed_order_attention,
    fixed_order_decode,
)

SHAPES = st.sampled_from([(1, 1, 8), (4, 2, 16), (9, 3, 64)])  # heads, kv heads, head size


def qkv(heads, kv_heads, dim, length, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, dim, generator=gen) * 2
    k = torch.randn(1, kv_heads, length, dim, generator=gen) * 2
    v = torch.randn(1, kv_heads, length, dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, length=st.integers(1, 600), seed=st.integers(0, 2**16),
       cuts=st.lists(st.integers(1, 300), min_size=1, max_size=6),
       extra=st.sampled_from([0, 3, 70]))
def test_a_row_gets_the_same_bits_in_any_call(shape, length, seed, cuts, extra):
    """Rows computed whole, in chunks (with masked keys past the chunk), and alone over
    exactly their own keys (a decode) are bit for bit the same."""
    heads, kv_heads, dim = shape
    q, k, v = qkv(heads, kv_heads, dim, length + extra, seed)
    q = q[:, :, :length]
    whole = fixed_order_attention(q, k[:, :, :length], v[:, :, :length], dim**-0.5)
    start, i = 0, 0
    while start < length:
        end = min(length, start + cuts[i % len(cuts)])
        part = fixed_order_attention(q[:, :, start:end], k, v, dim**-0.5, offset=start)
        assert torch.equal(part, whole[:, start:end])
        start, i = end, i + 1
    for row in {0, length // 2, length - 1}:
        alone = fixed_order_attention(q[:, :, row : row + 1], k[:, :, : row + 1],
                                      v[:, :, : row + 1], dim**-0.5)
        assert torch.equal(alone, whole[:, row : row + 1])


@settings(max_examples=15, deadline=None)
@given(shape=SHAPES, lengths=st.lists(st.integers(1, 700), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_decodes_together_get_the_bits_each_gets_alone(shape, lengths, seed):
    heads, kv_heads, dim = shape
    seqs = [qkv(heads, kv_heads, dim, n, seed + i) for i, n in enumerate(lengths)]
    query = torch.cat([q[:, :, -1:] for q, _, _ in seqs])
    keys, values = [k for _, k, _ in seqs], [v for _, _, v in seqs]
    together = fixed_order_decode(query, keys, values, dim**-0.5)
    assert together.shape == (len(lengths), 1, heads, dim)
    for i, (q, k, v) in enumerate(seqs):
        alone = fixed_order_attention(q[:, :, -1:], k, v, dim**-0.5)
        assert torch.equal(together[i : i + 1], alone)
    # straight into the model's dtype: the same bits as casting the float32 result
    as_model = fixed_order_decode(query, keys, values, dim**-0.5, out_dtype=torch.bfloat16)
    assert as_model.dtype == torch.bfloat16
    assert torch.equal(as_model, together.to(torch.bfloat16))
    if len(lengths) > 2:  # other lengths, then these again: the kept mask follows them
        assert torch.equal(fixed_order_decode(query[1:], keys[1:], values[1:], dim**-0.5),
                           together[1:])
        assert torch.equal(fixed_order_decode(query, keys, values, dim**-0.5), together)


@pytest.mark.parametrize("length", [1, MIN_QUERY_ROWS - 1, 100, 300])
def test_it_is_causal_attention(length):
    heads, kv_heads, dim = 9, 3, 64
    q, k, v = qkv(heads, kv_heads, dim, length, seed=length, dtype=torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    got = fixed_order_attention(q, k, v, dim**-0.5)
    assert got.shape == (1, length, heads, dim)
    torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_an_explicit_mask_is_obeyed_and_a_row_with_no_key_gives_zeros():
    q, k, v = qkv(2, 2, 16, 40, seed=3, dtype=torch.float32)
    allowed = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
    causal = fixed_order_attention(q, k, v, 0.25)
    assert torch.equal(fixed_order_attention(q, k, v, 0.25, allowed=allowed), causal)
    allowed[0, 0, 5] = False  # row 5 may see nothing
    allowed[0, 0, 9, :3] = False  # row 9 does not see keys 0-2
    got = fixed_order_attention(q, k, v, 0.25, allowed=allowed)
    assert torch.equal(got[:, 5], torch.zeros_like(got[:, 5]))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, 9:10], k[:, :, 3:10], v[:, :, 3:10], scale=0.25).transpose(1, 2)
    torch.testing.assert_close(got[:, 9:10], expected, rtol=1e-5, atol=1e-6)


def test_torch_sdpa_does_not_have_the_property():
    """Why the kernel exists: SDPA's decode row differs from its whole-prompt row."""
    q, k, v = qkv(9, 9, 64, 300, seed=0)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    alone = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in range(300)], dim=2)
    assert not torch.equal(alone, whole)


@pytest.mark.parametrize("q_shape,k_shape", [((1, 4, 0, 8), (1, 2, 5, 8)),
                                             ((1, 4, 3, 8), (1, 3, 5, 8)),
                                             ((1, 4, 3, 8), (1, 2, 0, 8))])
def test_shapes_it_cannot_attend_are_refused(q_shape, k_shape):
    with pytest.raises(ValueError):
        fixed_order_attention(torch.zeros(q_shape), torch.zeros(k_shape),
                              torch.zeros(k_shape), 1.0)
    with pytest.raises(ValueError):
        fixed_order_decode(torch.zeros(q_shape), [torch.zeros(k_shape)],
                           [torch.zeros(k_shape)], 1.0)
