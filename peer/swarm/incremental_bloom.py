"""Pure: the Bloom filter of a peer's cached blocks, kept current block by block.

The filter is blocked (protocols/bloom.py): a key sets bits in exactly one 512-bit block,
so a removal only recomputes that block from the keys still in it. The bytes always equal
those of a filter rebuilt from the cached hashes. `CacheFilter` feeds one from the radix
cache's stored/removed events and gives it the live sizing's shape at each publish; the
gossip shell (peer/swarm/gossip.py) and the simulator (bench/sim/) both use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from peer.engine.radix import MAX_PENDING_EVENTS, EventKind
from peer.swarm.bloom_sizing import summary_bloom
from protocols.bloom import BLOCK_BITS, BloomFilter, Probes

__all__ = ["MAX_MEMO_KEYS", "CacheFilter", "IncrementalBloom", "Memo", "Shape"]

_BLOCK_BYTES = BLOCK_BITS // 8
MAX_MEMO_KEYS = 1 << 19  # a shared memo's bound: ~100 MB; cleared when full

Shape = tuple[int, int]  # (num_bits, num_hashes)
Memo = dict[int, tuple[int, int]]  # key -> (filter block, in-block mask), for one shape


class _EventLike(Protocol):
    @property
    def kind(self) -> EventKind: ...
    @property
    def block_hash(self) -> int: ...


class _CacheLike(Protocol):
    @property
    def public_blocks(self) -> int: ...
    def cached_hashes(self) -> Iterable[int]: ...


class IncrementalBloom:
    """The Bloom filter of a changing key set, with O(keys per 512-bit block) removals."""

    __slots__ = ("_blocks", "_bytes", "_count", "_keys", "_memo", "_num_blocks", "_num_hashes")

    def __init__(self, template: BloomFilter, memo: Memo | None = None) -> None:
        """Empty, of `template`'s shape (the template is not modified). Filters of one
        shape may share `memo`, so that a key held by many of them is mixed once (the
        simulator); without one, nothing is remembered beyond the keys themselves."""
        self._num_blocks = template.num_bits // BLOCK_BITS
        self._num_hashes = template.num_hashes
        self._memo = memo
        self._keys: list[dict[int, int]] = [{} for _ in range(self._num_blocks)]  # key -> mask
        self._blocks: list[int] = [0] * self._num_blocks
        self._count = 0
        self._bytes: bytes | None = None

    @property
    def num_bits(self) -> int:
        return self._num_blocks * BLOCK_BITS

    @property
    def num_hashes(self) -> int:
        return self._num_hashes

    @property
    def shape(self) -> Shape:
        return self.num_bits, self._num_hashes

    def __len__(self) -> int:
        return self._count

    def _locate(self, key: int) -> tuple[int, int]:
        memo = self._memo
        found = None if memo is None else memo.get(key)
        if found is None:
            probes = Probes((key,))
            found = ((probes.hashes[0] * self._num_blocks) >> 64, probes.masks(self._num_hashes)[0])
            if memo is not None:
                if len(memo) >= MAX_MEMO_KEYS:
                    memo.clear()
                memo[key] = found
        return found

    def add(self, key: int) -> None:
        """Insert a key (idempotent)."""
        index, mask = self._locate(key)
        keys = self._keys[index]
        if key not in keys:
            self._count += 1
        keys[key] = mask
        self._blocks[index] |= mask
        self._bytes = None

    def remove(self, key: int) -> None:
        """Forget a key; ValueError if it is not in the filter."""
        index, _ = self._locate(key)
        keys = self._keys[index]
        if keys.pop(key, None) is None:
            raise ValueError(f"key {key:#x} is not in the filter")
        self._count -= 1
        block = 0
        for mask in keys.values():
            block |= mask
        self._blocks[index] = block
        self._bytes = None

    def to_bytes(self) -> bytes:
        """The wire bytes (protocols/bloom.py layout); cached until the next change."""
        if self._bytes is None:
            self._bytes = b"".join(b.to_bytes(_BLOCK_BYTES, "little") for b in self._blocks)
        return self._bytes

    def to_filter(self) -> BloomFilter:
        """A BloomFilter with the same bits (a copy)."""
        return BloomFilter.from_bytes(self.num_bits, self._num_hashes, self.to_bytes())


class CacheFilter:
    """A cache's Bloom filter, fed its stored/removed events, shaped for publishing.

    `current(cache)` gives the filter the shape `summary_bloom` picks for the cache's size
    now (or the fixed `shape`), rebuilt from `cache.cached_hashes()` when that shape
    changed or events may have been lost (the radix cache drops the oldest once
    MAX_PENDING_EVENTS wait; a drained batch that long may lack some)."""

    __slots__ = ("_bloom", "_fixed", "_fp_rate", "_memos", "_stale")

    def __init__(
        self,
        fp_rate: float,
        *,
        shape: Shape | None = None,
        memos: dict[Shape, Memo] | None = None,
    ) -> None:
        """`shape` fixes the filter's shape instead; `memos` (per shape) may be shared
        between the filters of many caches (see IncrementalBloom)."""
        self._fp_rate = fp_rate
        self._fixed = shape
        self._memos = memos
        self._bloom = self._empty(shape if shape is not None else self._shape_for(0))
        self._stale = False

    @property
    def bloom(self) -> IncrementalBloom:
        """The filter as the events left it (`current` reshapes and checks it)."""
        return self._bloom

    def _shape_for(self, cached_blocks: int) -> Shape:
        if self._fixed is not None:
            return self._fixed
        bloom = summary_bloom(cached_blocks, self._fp_rate)
        return bloom.num_bits, bloom.num_hashes

    def _empty(self, shape: Shape) -> IncrementalBloom:
        memo = None if self._memos is None else self._memos.setdefault(shape, {})
        return IncrementalBloom(BloomFilter(*shape), memo)

    def observe(self, events: Sequence[_EventLike]) -> None:
        """Apply one batch of the cache's stored/removed events (`drain_events()`)."""
        if len(events) >= MAX_PENDING_EVENTS:
            self._stale = True
            return
        bloom = self._bloom
        for ev in events:
            if ev.kind is EventKind.STORED:
                bloom.add(ev.block_hash)
            elif ev.kind is EventKind.REMOVED:
                try:
                    bloom.remove(ev.block_hash)
                except ValueError:  # its STORED event was lost: rebuild at publish
                    self._stale = True

    def current(self, cache: _CacheLike) -> IncrementalBloom:
        """The filter of exactly `cache`'s blocks, in the shape to publish now (every
        event drained so far must have been observed)."""
        public_blocks = cache.public_blocks  # the count of cached_hashes()
        shape = self._shape_for(public_blocks)
        if self._stale or shape != self._bloom.shape or len(self._bloom) != public_blocks:
            bloom = self._empty(shape)
            for key in cache.cached_hashes():
                bloom.add(key)
            self._bloom = bloom
            self._stale = False
        return self._bloom
