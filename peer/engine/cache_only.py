"""An engine with a radix cache and no model (no torch): membership tests, the gossip
benchmark and `python -m peer.node_runner` without --model. It never generates; fill its
cache with `insert(tokens)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from protocols.blocks import BlockHasher

from .api import EngineLoad, GeneratingEngine
from .radix import RadixCache

__all__ = ["CACHE_ONLY_CAPACITY_BLOCKS", "CACHE_ONLY_MODEL_ID", "CacheOnlyEngine"]

CACHE_ONLY_MODEL_ID = "prefixswarm/cache-only"  # never a real model: no peer mixes them up
CACHE_ONLY_CAPACITY_BLOCKS = 1456  # what 1 GiB holds for SmolLM2 (46 KB/token, 16/block)


class CacheOnlyEngine:
    """An EngineView (api.py): a radix cache, an idle load, nothing to generate with."""

    def __init__(
        self,
        model_id: str = CACHE_ONLY_MODEL_ID,
        block_size: int = 16,
        capacity_blocks: int = CACHE_ONLY_CAPACITY_BLOCKS,
    ) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.hasher = BlockHasher(model_id, block_size)
        self.cache: RadixCache[None] = RadixCache(block_size, capacity_blocks, self.hasher)

    def insert(self, tokens: list[int]) -> None:
        self.cache.insert(tokens, lambda _block: None, trio.current_time())

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0.0, 0.0)  # idle, unmeasured, does not batch

    def local_match_tokens(self, token_ids: Sequence[int]) -> int:
        return self.cache.peek(token_ids)

    def generating(self) -> GeneratingEngine | None:
        return None
