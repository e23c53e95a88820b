"""KV blocks: their shape and size, and the byte budget in blocks.

A block's value is one tensor [layers, 2, kv_heads, block_size, head_dim] (2 = key, value),
a private contiguous copy so that evicting the block frees its memory. A running sequence
copies its matched blocks into its own buffer (runner.SeqKV), so a stored block is never
written to and can be shared by any number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass

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
