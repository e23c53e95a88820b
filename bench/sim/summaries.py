"""A peer's Bloom summary kept current block by block, bit-identical to a full rebuild.

`peer.swarm.local_summary.build_summary` rebuilds the filter from every cached hash at each publish
(~3 ms per 1,000 blocks in CPython). A simulated swarm publishes hundreds of thousands of
summaries, so the simulator instead keeps the same filter up to date from the radix
cache's STORED/REMOVED events. The filter is *blocked* (protocols/bloom.py): a key sets
bits in exactly one 512-bit block, chosen from its mixed hash, so removing a key only
needs that block recomputed from the keys still in it. The bytes produced are exactly
those of `BloomFilter(num_bits, num_hashes)` after `update(cached hashes)`
(tests/test_simulate.py checks this against the real class), and receivers decode them
with the real `BloomFilter.from_bytes` inside the real `PeerTable.apply`.
"""

from __future__ import annotations

from protocols.bloom import BLOCK_BITS, BloomFilter, Probes

_BLOCK_BYTES = BLOCK_BITS // 8
MAX_MEMO_KEYS = 1 << 19  # ~100 MB at most; a 20k-request run stores ~200k distinct blocks


class IncrementalBloom:
    """The Bloom filter of a changing key set, with O(keys per 512-bit block) removals."""

    __slots__ = ("_blocks", "_bytes", "_keys", "_memo", "_num_blocks", "_num_hashes")

    def __init__(self, template: BloomFilter, memo: dict[int, tuple[int, int]] | None = None
                 ) -> None:
        """Same shape as `template` (an empty filter from `BloomFilter.for_capacity` or
        the constructor); the template itself is not modified. Filters of one shape may
        share `memo` (key -> filter block and in-block mask), so that a block hash cached
        on many peers is mixed once."""
        self._num_blocks = template.num_bits // BLOCK_BITS
        self._num_hashes = template.num_hashes
        self._memo: dict[int, tuple[int, int]] = {} if memo is None else memo
        # Per filter block: key -> its in-block mask.
        self._keys: list[dict[int, int]] = [{} for _ in range(self._num_blocks)]
        self._blocks: list[int] = [0] * self._num_blocks
        self._bytes: bytes | None = None

    @property
    def num_bits(self) -> int:
        return self._num_blocks * BLOCK_BITS

    @property
    def num_hashes(self) -> int:
        return self._num_hashes

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._keys)

    def _locate(self, key: int) -> tuple[int, int]:
        found = self._memo.get(key)
        if found is None:
            probes = Probes((key,))
            h = probes.hashes[0]
            found = ((h * self._num_blocks) >> 64, probes.masks(self._num_hashes)[0])
            if len(self._memo) >= MAX_MEMO_KEYS:
                self._memo.clear()
            self._memo[key] = found
        return found

    def add(self, key: int) -> None:
        """Insert a key (idempotent)."""
        index, mask = self._locate(key)
        self._keys[index][key] = mask
        self._blocks[index] |= mask
        self._bytes = None

    def remove(self, key: int) -> None:
        """Forget a key; ValueError if it was never added."""
        index, _ = self._locate(key)
        keys = self._keys[index]
        if keys.pop(key, None) is None:
            raise ValueError(f"key {key:#x} is not in the filter")
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
