"""KV storage per block: cut a transformers cache into block tensors and rebuild one from them.

A block's value is one tensor [layers, 2, kv_heads, block_size, head_dim] (2 = key, value),
a private contiguous copy so that evicting the block frees its memory. Blocks are shared
by reference between requests: transformers appends to a cache by concatenation, so a
stored tensor is never written to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k SmolLM2 tokens of fp32 KV, fits a volunteer laptop


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block's KV tensor and its size in bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    itemsize: int  # bytes per element (4 for fp32)

    @property
    def block_bytes(self) -> int:
        """Bytes held by one block."""
        per_token = self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize
        return per_token * self.block_size

    def capacity_blocks(self, cache_bytes: int) -> int:
        """How many whole blocks fit in `cache_bytes`."""
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        return cache_bytes // self.block_bytes


def cache_from_blocks(blocks: Sequence[torch.Tensor]) -> DynamicCache:
    """A fresh DynamicCache (batch 1) holding the given blocks in order; empty if none."""
    if not blocks:
        return DynamicCache()
    kv = torch.cat(list(blocks), dim=3) if len(blocks) > 1 else blocks[0]
    # kv: [layers, 2, heads, tokens, head_dim] -> per layer ([1, heads, tokens, dim],) * 2
    return DynamicCache(ddp_cache_data=[(kv[i, 0:1], kv[i, 1:2]) for i in range(kv.shape[0])])


def blocks_from_cache(
    cache: DynamicCache, first_block: int, end_block: int, block_size: int
) -> list[torch.Tensor]:
    """Copies of blocks [first_block, end_block) of a batch-1 cache, one tensor per block."""
    if end_block <= first_block:
        return []
    start, stop = first_block * block_size, end_block * block_size
    if cache.get_seq_length() < stop:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, blocks need {stop}")
    # [layers, 2, heads, tokens, dim] over the wanted range, then one private copy per block.
    layers: list[Any] = list(cache.layers)
    span = torch.stack(
        [torch.stack((la.keys[0, :, start:stop], la.values[0, :, start:stop])) for la in layers]
    )
    parts: list[torch.Tensor] = list(torch.split(span, block_size, dim=3))
    return [part.clone(memory_format=torch.contiguous_format) for part in parts]
