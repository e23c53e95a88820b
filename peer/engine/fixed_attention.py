"""Attention whose every row is computed the same way whatever call it is in (torch).

torch's CPU SDPA blocks a call's query rows by the call's size and reads each block's
keys up to the call's end, so a row's rounding depends on the call: a prompt read whole,
in chunks, after a cached prefix, or a decode's single row all round differently
(docs/engine.md, "Exactness"). This kernel gives a row the same arithmetic in all of
them, so that with row-invariant projections (the int8 and int4 weight-only kernels) a
batched, chunked, cached answer is bit for bit the one a sequential forward gives:

- scores are one matrix product of at least MIN_QUERY_ROWS query rows (torch's product
  of 1 or 2 rows takes another path that sums the head dimension in another order; from
  7 rows on every row's dot products were the same at every call size measured on
  AVX-512 machines; on an AVX2-only one, MKL's products of 9 to 11 rows round their rows
  past the eighth another way, so those counts are padded to ODD_ROWS_PADDED_TO, and
  products fewer than MIN_VALUE_COLUMNS wide round a row by its position in the call, so
  the values get zero columns up to that width);
- masked and padding keys get -inf, so they add exactly 0; the row maximum is exact in any
  order; the key axis is padded to KEY_LANE so that the exponential takes the vector path
  for every element (its scalar tail can differ in the last bit);
- the weighted sum of values and the softmax denominator (a column of ones appended to
  the values) are summed in blocks of KEY_BLOCK keys at fixed positions from key 0, one
  matrix product per block (a longer product splits its keys where its own blocking
  decides), added block after block; the last block is 64, 128 or 256 keys wide (`_padded`).

Computed in float32 whatever the model's dtype; the caller casts the result back. Slower
than SDPA (more, smaller operations): the engine uses it where it buys exactness.
`fixed_order_decode` computes many sequences' decode rows in one call, with the same bits
each gets alone (its keys padded to the longest: masked, so they add exactly 0).
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["KEY_BLOCK", "KEY_LANE", "MIN_QUERY_ROWS", "fixed_order_attention", "fixed_order_decode"]

MIN_QUERY_ROWS = 8  # fewer query rows are padded to this many (see above)
ODD_ROWS_PADDED_TO = 12  # ...and more than MIN_QUERY_ROWS but fewer than this, to this many
MIN_VALUE_COLUMNS = 16  # [values | 1] is widened with zero columns to at least this
KEY_LANE = 64  # the key axis is padded to a multiple of this: 2 AVX-512 vectors of floats
KEY_BLOCK = 256  # keys summed per matrix product; a multiple of KEY_LANE
# Scratch buffers are kept per thread and reused by the next call (every layer of a step
# has the same shapes): a fresh multi-megabyte tensor is fresh pages, and faulting them
# in cost more than the arithmetic. Up to this many floats each (64 MB); larger ones are
# allocated per call.
MAX_SCRATCH_FLOATS = 16 << 20
_scratch_pools = threading.local()


def fixed_order_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    offset: int | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of ``query`` [B, Hq, n, D] over ``key`` / ``value`` [B, Hkv, L, D]
    (Hq a multiple of Hkv: grouped-query heads share their group's key), as [B, n, Hq, D]
    float32. Row i attends keys j <= offset + i (causal; ``offset`` defaults to L - n), or,
    given ``allowed`` (bool, broadcastable to [B, 1, n, L]), where it is True; a row with no
    allowed key gives zeros."""
    batch, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if n < 1 or length < 1 or heads % kv_heads:
        raise ValueError(f"cannot attend {tuple(query.shape)} over {tuple(key.shape)}")
    rows = _query_rows(n)
    padded = _padded(length)
    q = _scratch("q", (batch, heads, rows, dim), query.device)
    q[:, :, :n].copy_(query)
    if rows > n:  # padding rows repeat the last one: valid, and dropped at the end
        q[:, :, n:].copy_(query[:, :, n - 1 :])
    k, v = _keys_and_values(batch, kv_heads, padded, dim, query.device)
    _fill(k, v, slice(None), key, value)
    scores = _scores(q, k, scaling)
    grid = scores.view(batch, kv_heads, heads // kv_heads, rows, padded)
    if allowed is None:
        first = length - n if offset is None else offset
        if n == 1 and first + 1 >= length:
            grid[..., length:] = float("-inf")  # a decode: only the padding is masked
        else:
            last_key = torch.arange(first, first + rows, device=q.device).clamp_(
                max=first + n - 1)
            keys = torch.arange(padded, device=q.device)
            grid.masked_fill_(keys[None, :] > last_key[:, None], float("-inf"))
    else:
        mask = torch.zeros((batch, 1, rows, padded), dtype=torch.bool, device=q.device)
        mask[:, :, :n, :length] = allowed.expand(batch, 1, n, length)
        if rows > n:
            mask[:, :, n:] = mask[:, :, n - 1 : n]
        grid.masked_fill_(~mask[:, :, None], float("-inf"))
    out = _softmax_times_values(scores, v, dim, none_allowed=allowed is not None)
    out = out.view(batch, kv_heads, heads // kv_heads, rows, dim)[:, :, :, :n]
    return out.reshape(batch, heads, n, dim).transpose(1, 2)


def fixed_order_decode(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One new row per sequence: ``query`` [S, Hq, 1, D], sequence s attending all of
    ``keys[s]`` / ``values[s]`` ([1, Hkv, L_s, D]); [S, 1, Hq, D] in ``out_dtype``, each row
    bit for bit what `fixed_order_attention` gives it alone, cast to that dtype. A kv head's
    group of query rows is padded as one call's rows are (`_query_rows`: the products' rows
    do not depend on their count from there), not each row on its own as a call of one row
    is.
    Every layer of a step calls this with the same lengths: the mask is made once."""
    count, heads, n, dim = query.shape
    if n != 1 or count != len(keys) or count != len(values) or not count:
        raise ValueError(f"one row per sequence: {tuple(query.shape)}, {len(keys)} sequences")
    kv_heads = keys[0].shape[1]
    lengths = tuple(int(k.shape[2]) for k in keys)
    if min(lengths) < 1 or heads % kv_heads:
        raise ValueError(f"cannot attend {tuple(query.shape)} over lengths {lengths}")
    group = heads // kv_heads
    rows = _query_rows(group)
    padded = _padded(max(lengths))
    q = _scratch("q", (count, kv_heads, rows, dim), query.device)
    q[:, :, :group].copy_(query.reshape(count, kv_heads, group, dim))
    if rows > group:  # padding rows repeat the group's last: valid, and dropped at the end
        q[:, :, group:].copy_(q[:, :, group - 1 : group])
    k, v = _keys_and_values(count, kv_heads, padded, dim, query.device)
    for s, (key, value) in enumerate(zip(keys, values, strict=True)):
        _fill(k, v, slice(s, s + 1), key, value)
    scores = _scores(q, k, scaling)  # [S, Hkv, rows, padded]
    if count == 1:
        if padded > lengths[0]:
            scores[..., lengths[0]:] = float("-inf")  # the padding past its keys
    else:
        scores.masked_fill_(_beyond(lengths, padded, q.device), float("-inf"))
    total = _weighted_values(scores, v, none_allowed=False)
    # every row has a key, so its denominator is >= 1: the clamp of the general case is moot
    out = torch.empty((count, kv_heads, group, dim), dtype=out_dtype, device=query.device)
    torch.div(total[:, :, :group, :dim], total[:, :, :group, dim : dim + 1], out=out)
    return out.view(count, 1, heads, dim)


def _beyond(lengths: tuple[int, ...], padded: int, device: torch.device) -> torch.Tensor:
    """[S, 1, 1, padded]: True past each sequence's keys; the last one made is kept for
    the next call (a step's layers share their lengths)."""
    key = (lengths, padded, device, torch.is_inference_mode_enabled())
    kept: tuple[object, torch.Tensor] | None = getattr(_scratch_pools, "beyond", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    ends = torch.tensor(lengths, device=device)
    mask = (torch.arange(padded, device=device)[None, :] >= ends[:, None])[:, None, None]
    _scratch_pools.beyond = (key, mask)
    return mask


def _query_rows(n: int) -> int:
    """How many rows a product of ``n`` query rows is padded to (see above)."""
    rows = max(n, MIN_QUERY_ROWS)
    return ODD_ROWS_PADDED_TO if MIN_QUERY_ROWS < rows < ODD_ROWS_PADDED_TO else rows


def _padded(length: int) -> int:
    """The key axis: a multiple of KEY_LANE whose last KEY_BLOCK block is a power of two
    wide (an AVX2-only machine's MKL sums a 192-key product in another order than a
    256-key one whose last 64 weights are zero; 64 and 128 keys, the same)."""
    padded = -(-length // KEY_LANE) * KEY_LANE
    tail = padded % KEY_BLOCK
    return padded if tail & (tail - 1) == 0 else padded - tail + KEY_BLOCK


def _keys_and_values(
    batch: int, kv_heads: int, padded: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 buffers for the keys, and for the values with a column of ones after them
    (it sums the softmax's denominator in the same products as the values), then zero
    columns up to MIN_VALUE_COLUMNS."""
    v = _scratch("v", (batch, kv_heads, padded, max(dim + 1, MIN_VALUE_COLUMNS)), device)
    v[..., dim] = 1.0
    v[..., dim + 1 :] = 0.0
    return _scratch("k", (batch, kv_heads, padded, dim), device), v


def _scratch(role: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``shape`` whose contents are garbage: this thread's buffer for
    ``role``, grown as needed (see MAX_SCRATCH_FLOATS)."""
    size = math.prod(shape)
    if size > MAX_SCRATCH_FLOATS:
        return torch.empty(shape, dtype=torch.float32, device=device)
    pool: dict[tuple[str, torch.device, bool], torch.Tensor] | None = getattr(
        _scratch_pools, "pool", None)
    if pool is None:
        pool = _scratch_pools.pool = {}
    # a tensor made under inference mode cannot be written outside it: one buffer each
    key = (role, device, torch.is_inference_mode_enabled())
    buf = pool.get(key)
    if buf is None or buf.numel() < size:
        buf = pool[key] = torch.empty(size, dtype=torch.float32, device=device)
    return buf[:size].view(shape)


def _fill(k: torch.Tensor, v: torch.Tensor, rows: slice, key: torch.Tensor,
          value: torch.Tensor) -> None:
    """Copy ``key`` / ``value`` into batch rows ``rows`` of the buffers, whose values'
    column ``dim`` is all ones (`_keys_and_values`); the padding keys' scores are masked
    whatever they hold, their values (and ones) must be 0."""
    length, dim = key.shape[2], key.shape[3]
    k[rows, :, :length].copy_(key)
    v[rows, :, :length, :dim].copy_(value)
    v[rows, :, length:] = 0.0


def _scores(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """[B, Hkv, group * rows, padded]: each kv head's group of query heads in one product."""
    batch, kv_heads, padded, dim = k.shape
    rows = q.numel() // (batch * kv_heads * dim)
    scores = _scratch("scores", (batch, kv_heads, rows, padded), k.device)
    torch.matmul(q.view(batch, kv_heads, rows, dim), k.transpose(-1, -2), out=scores)
    return scores.mul_(scaling)


def _softmax_times_values(scores: torch.Tensor, v: torch.Tensor, dim: int,
                          none_allowed: bool) -> torch.Tensor:
    """The masked ``scores`` made softmax weights in place, times the values summed in
    KEY_BLOCK blocks; [B, Hkv, group * rows, D]. ``none_allowed``: a row may have no key."""
    total = _weighted_values(scores, v, none_allowed)
    # the denominator is >= 1 for a row with any allowed key (its maximum adds exp(0))
    return total[..., :dim] / total[..., dim : dim + 1].clamp_min(1.0)


def _weighted_values(scores: torch.Tensor, v: torch.Tensor, none_allowed: bool) -> torch.Tensor:
    """exp(scores - row max) in place, times [values | 1] summed in KEY_BLOCK blocks:
    [B, Hkv, group * rows, D + 1], the softmax's numerators then its denominator."""
    top = scores.amax(dim=-1, keepdim=True)
    if none_allowed:
        top.nan_to_num_(neginf=0.0)  # a row with nothing allowed: exp(-inf) = 0 throughout
    scores.sub_(top).exp_()
    total: torch.Tensor | None = None
    for start in range(0, scores.shape[-1], KEY_BLOCK):
        part = torch.matmul(scores[..., start : start + KEY_BLOCK],
                            v[:, :, start : start + KEY_BLOCK])
        total = part if total is None else total.add_(part)
    assert total is not None
    return total
