"""Bloom filter over 64-bit block hashes: sizing, membership, prefix walks, (de)serialising.

A blocked filter (each key in one 512-bit block): a membership test is one big-int AND,
and a key's in-block mask does not depend on the filter's size, so a prompt's chain is
mixed once (`Probes`, memoised by `ProbeCache`) and tested against every peer's filter.
No false negatives; a false hit costs a cache miss, never a wrong answer. The layout is
the wire format of `CacheSummary.bloom` (docs/protocol.md section 4).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence

__all__ = [
    "BLOCK_BITS",
    "DEFAULT_PROBE_CACHE_KEYS",
    "KEY_SEED",
    "MAX_BLOOM_BITS",
    "MAX_BLOOM_HASHES",
    "MAX_FP_RATE",
    "MIN_FP_RATE",
    "POSITION_SEED",
    "BloomFilter",
    "ProbeCache",
    "Probes",
    "mix64",
]

BLOCK_BITS = 512  # one 64-byte cache line per key; keeps the false-positive cost ~4% bits
_BLOCK_BYTES = BLOCK_BITS // 8
# 4 Mi bits = 512 KiB: fits py-libp2p's 1 MiB gossipsub message with room for the signed
# envelope, and holds ~420k blocks (6.7M tokens at 16 per block) at 1%.
MAX_BLOOM_BITS = 1 << 22
MAX_BLOOM_HASHES = 16  # more never helps for rates >= MIN_FP_RATE; bounds work per key
MIN_FP_RATE = 1e-4  # below this a blocked filter wastes space; a false hit only costs a miss
MAX_FP_RATE = 0.5  # above this the filter carries no useful information
KEY_SEED = 0x7072_6566_6978_7377  # "prefixsw": protocol constant, part of the wire format

# Entries (a hash, or a mask for one num_hashes) kept between halvings: the chains of ~2k
# recent 32-block prompts, at most ~13 MB (a 512-bit mask is ~100 bytes with its slot).
DEFAULT_PROBE_CACHE_KEYS = 1 << 16
_M64 = (1 << 64) - 1
POSITION_SEED = 0x5BD1E9955BD1E995  # decorrelates in-block positions from the block index
_CHUNKS_PER_MIX = 7  # 9-bit positions per 64-bit mixed word
_MAX_BLOCKS = MAX_BLOOM_BITS // BLOCK_BITS


def mix64(x: int) -> int:
    """The splitmix64 finalizer: a fast bijective mixing of a 64-bit int."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _check_key(key: int) -> None:
    if type(key) is not int:
        raise TypeError(f"Bloom keys are 64-bit ints, got {type(key).__name__}")
    if not 0 <= key <= _M64:
        raise ValueError(f"Bloom key out of the unsigned 64-bit range: {key}")


_BIT = tuple(1 << i for i in range(BLOCK_BITS))  # table lookup beats shifting big ints


def _mask(h: int, num_hashes: int) -> int:
    """The in-block bits of a key: `num_hashes` 9-bit chunks of further mixings of `h`."""
    mask = 0
    g = 0
    for i in range(num_hashes):
        if i % _CHUNKS_PER_MIX == 0:
            g = mix64(h ^ (POSITION_SEED + i))
        mask |= _BIT[g & (BLOCK_BITS - 1)]
        g >>= 9
    return mask


class Probes:
    """A key sequence mixed once, to be tested against many filters (the router's fast path).

    A key's in-block mask depends only on the key and `num_hashes`, and its block only on
    the filter's block count, so both are computed on first use and kept here: testing a
    prompt's chain against 64 peers' filters then costs ~0.1 us per probe.
    """

    __slots__ = ("_cache", "_hashes", "_indices", "_keys", "_masks")

    def __init__(self, keys: Iterable[int], cache: ProbeCache | None = None) -> None:
        self._keys = tuple(keys)
        for key in self._keys:
            _check_key(key)
        self._cache = cache
        self._hashes = (
            cache.hashes(self._keys) if cache else tuple(mix64(k ^ KEY_SEED) for k in self._keys)
        )
        self._masks: dict[int, tuple[int, ...]] = {}
        self._indices: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> tuple[int, ...]:
        return self._keys

    @property
    def hashes(self) -> tuple[int, ...]:
        """The mixed 64-bit hashes, one per key, in order."""
        return self._hashes

    def masks(self, num_hashes: int) -> tuple[int, ...]:
        """The in-block bit masks for filters with `num_hashes` hash functions."""
        masks = self._masks.get(num_hashes)
        if masks is None:
            if self._cache is not None:
                masks = self._cache.masks(self._keys, self._hashes, num_hashes)
            else:
                masks = tuple(_mask(h, num_hashes) for h in self._hashes)
            self._masks[num_hashes] = masks
        return masks

    def indices(self, num_blocks: int) -> tuple[int, ...]:
        """The block of each key in a filter of `num_blocks` blocks."""
        indices = self._indices.get(num_blocks)
        if indices is None:
            indices = tuple((h * num_blocks) >> 64 for h in self._hashes)
            self._indices[num_blocks] = indices
        return indices


class ProbeCache:
    """A bounded memo of per-key hashes and masks, shared across routing decisions.

    Prompts share prefixes (system prompts, conversations), so the same block hashes are
    probed again and again; mixing a key costs ~3 us in CPython, a lookup ~0.1 us. When
    full, the older half is dropped (FIFO, amortised O(1)).
    """

    __slots__ = ("_entries", "_hits", "_max_keys", "_misses")

    def __init__(self, max_keys: int = DEFAULT_PROBE_CACHE_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self._max_keys = max_keys
        # key -> hash, and key | (num_hashes << 64) -> mask; at most 2 * max_keys entries.
        self._entries: dict[int, int] = {}
        self._hits = 0
        self._misses = 0

    def probes(self, keys: Iterable[int]) -> Probes:
        """`Probes` for `keys`, computed through this cache."""
        return Probes(keys, cache=self)

    def hashes(self, keys: Sequence[int]) -> tuple[int, ...]:
        """The mixed hash of each key (keys already checked by the caller)."""
        out = []
        for key in keys:
            h = self._entries.get(key)
            if h is None:
                h = mix64(key ^ KEY_SEED)
                self._store(key, h)
            out.append(h)
        self._hits += len(keys)
        return tuple(out)

    def masks(
        self, keys: Sequence[int], hashes: Sequence[int], num_hashes: int
    ) -> tuple[int, ...]:
        """The mask of each key for `num_hashes` hash functions."""
        tag = num_hashes << 64
        out = []
        for key, h in zip(keys, hashes, strict=True):
            mask = self._entries.get(key | tag)
            if mask is None:
                mask = _mask(h, num_hashes)
                self._store(key | tag, mask)
            out.append(mask)
        self._hits += len(keys)
        return tuple(out)

    def _store(self, slot: int, value: int) -> None:
        self._hits -= 1  # the caller counts every lookup as a hit
        self._misses += 1
        if len(self._entries) >= 2 * self._max_keys:
            keep = itertools.islice(self._entries.items(), self._max_keys, None)
            self._entries = dict(keep)
        self._entries[slot] = value

    def statistics(self) -> dict[str, int]:
        return {"entries": len(self._entries), "hits": self._hits, "misses": self._misses}


def _check_shape(num_bits: int, num_hashes: int) -> None:
    if type(num_bits) is not int or type(num_hashes) is not int:
        raise TypeError("num_bits and num_hashes must be ints")
    if not BLOCK_BITS <= num_bits <= MAX_BLOOM_BITS or num_bits % BLOCK_BITS:
        raise ValueError(
            f"num_bits must be a multiple of {BLOCK_BITS} in [{BLOCK_BITS}, {MAX_BLOOM_BITS}], "
            f"got {num_bits}"
        )
    if not 1 <= num_hashes <= MAX_BLOOM_HASHES:
        raise ValueError(f"num_hashes must be in [1, {MAX_BLOOM_HASHES}], got {num_hashes}")


@functools.lru_cache(maxsize=MAX_BLOOM_HASHES)  # memo of a pure function, 16 tiny entries
def _miss_terms(num_hashes: int) -> tuple[tuple[float, float], ...]:
    """Terms ``(c_i, r_i)`` with ``P(probe hits | j keys in its block) = sum c_i r_i^j``.

    A probe's ``k`` positions are uniform with replacement, so it tests ``d`` distinct bits
    with probability ``S2(k, d) N!/(N-d)!/N^k`` (``N`` = 512, ``S2`` Stirling numbers of the
    second kind); ``d`` given bits are all set after ``m = j k`` uniform throws with
    probability ``sum_i (-1)^i C(d, i) (1 - i/N)^m`` (inclusion-exclusion). Collecting by
    ``i`` gives ``c_i`` and ``r_i = (1 - i/N)^k``.
    """
    k, n = num_hashes, BLOCK_BITS
    stirling = [[0] * (k + 1) for _ in range(k + 1)]
    stirling[0][0] = 1
    for a in range(1, k + 1):
        for d in range(1, a + 1):
            stirling[a][d] = d * stirling[a - 1][d] + stirling[a - 1][d - 1]
    p_distinct = [
        stirling[k][d] * math.perm(n, d) / n**k for d in range(k + 1)
    ]
    terms = []
    for i in range(k + 1):
        c = sum(p_distinct[d] * (-1) ** i * math.comb(d, i) for d in range(i, k + 1))
        terms.append((c, (1.0 - i / n) ** k))
    return tuple(terms)


def _fp_rate(n: int, num_blocks: int, num_hashes: int) -> float:
    """Expected false-positive rate with `n` distinct keys in `num_blocks` blocks.

    Exact under uniform hashing: the number ``J`` of keys in the probe's block is
    Binomial(n, 1/num_blocks), and ``E[r^J] = (1 - (1 - r)/num_blocks)^n``.
    """
    if n <= 0:
        return 0.0
    total = sum(c * (1.0 - (1.0 - r) / num_blocks) ** n for c, r in _miss_terms(num_hashes))
    return min(max(total, 0.0), 1.0)


def _plan(capacity: int, fp_rate: float) -> tuple[int, int]:
    """(num_blocks, num_hashes) with the fewest blocks meeting `fp_rate` at `capacity`."""
    n = max(capacity, 1)
    best: tuple[int, int] | None = None
    for k in range(1, MAX_BLOOM_HASHES + 1):
        if _fp_rate(n, _MAX_BLOCKS, k) > fp_rate:
            continue
        lo, hi = 1, _MAX_BLOCKS  # smallest block count meeting the target, by bisection
        while lo < hi:
            mid = (lo + hi) // 2
            if _fp_rate(n, mid, k) <= fp_rate:
                hi = mid
            else:
                lo = mid + 1
        if best is None or lo < best[0]:
            best = (lo, k)
    if best is not None:
        return best
    # Over MAX_BLOOM_BITS: clamp, with the k that does best there (the rate exceeds target).
    k_best = min(range(1, MAX_BLOOM_HASHES + 1), key=lambda k: _fp_rate(n, _MAX_BLOCKS, k))
    return _MAX_BLOCKS, k_best


class BloomFilter:
    """A blocked Bloom filter of 64-bit keys (see the module docstring for the layout)."""

    __slots__ = ("_blocks", "_num_blocks", "_num_hashes")

    def __init__(self, num_bits: int, num_hashes: int) -> None:
        """An empty filter; ValueError unless `num_bits` is a multiple of 512 within bounds."""
        _check_shape(num_bits, num_hashes)
        self._num_blocks = num_bits // BLOCK_BITS
        self._num_hashes = num_hashes
        self._blocks: list[int] = [0] * self._num_blocks

    @classmethod
    def for_capacity(cls, capacity: int, fp_rate: float = 0.01) -> BloomFilter:
        """An empty filter sized so that `capacity` keys give at most `fp_rate` false hits.

        Beyond MAX_BLOOM_BITS the size is clamped and the rate exceeds the target
        (`expected_fp_rate(capacity)` says by how much).
        """
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        if not MIN_FP_RATE <= fp_rate <= MAX_FP_RATE:
            raise ValueError(f"fp_rate must be in [{MIN_FP_RATE}, {MAX_FP_RATE}], got {fp_rate}")
        num_blocks, num_hashes = _plan(capacity, float(fp_rate))
        return cls(num_blocks * BLOCK_BITS, num_hashes)

    @classmethod
    def from_bytes(cls, num_bits: int, num_hashes: int, data: bytes) -> BloomFilter:
        """The filter serialised by `to_bytes`; ValueError on inconsistent input."""
        _check_shape(num_bits, num_hashes)
        if len(data) != num_bits // 8:
            raise ValueError(
                f"a {num_bits}-bit filter needs {num_bits // 8} bytes, got {len(data)}"
            )
        bf = cls(num_bits, num_hashes)
        view = memoryview(data)
        bf._blocks = [
            int.from_bytes(view[i : i + _BLOCK_BYTES], "little")
            for i in range(0, len(view), _BLOCK_BYTES)
        ]
        return bf

    def to_bytes(self) -> bytes:
        """The bit array, `num_bits // 8` bytes (the layout in the module docstring)."""
        return b"".join(block.to_bytes(_BLOCK_BYTES, "little") for block in self._blocks)

    @property
    def num_bits(self) -> int:
        return self._num_blocks * BLOCK_BITS

    @property
    def num_hashes(self) -> int:
        return self._num_hashes

    def add(self, key: int) -> None:
        """Insert a 64-bit key."""
        _check_key(key)
        h = mix64(key ^ KEY_SEED)
        self._blocks[(h * self._num_blocks) >> 64] |= _mask(h, self._num_hashes)

    def update(self, keys: Iterable[int]) -> None:
        """Insert every key."""
        for key in keys:
            self.add(key)

    def __contains__(self, key: object) -> bool:
        if type(key) is not int:
            raise TypeError(f"Bloom keys are 64-bit ints, got {type(key).__name__}")
        _check_key(key)
        h = mix64(key ^ KEY_SEED)
        mask = _mask(h, self._num_hashes)
        return self._blocks[(h * self._num_blocks) >> 64] & mask == mask

    def count_prefix(self, keys: Sequence[int] | Probes) -> int:
        """How many leading keys test positive, stopping at the first miss."""
        probes = keys if isinstance(keys, Probes) else Probes(keys)
        blocks = self._blocks
        count = 0
        masks = probes.masks(self._num_hashes)
        for index, mask in zip(probes.indices(self._num_blocks), masks, strict=True):
            if blocks[index] & mask != mask:
                break
            count += 1
        return count

    def fill_ratio(self) -> float:
        """The fraction of bits set."""
        return sum(block.bit_count() for block in self._blocks) / self.num_bits

    def expected_fill(self, n: int) -> float:
        """The expected fill ratio after inserting `n` distinct keys."""
        return 1.0 - math.exp(-n * self._num_hashes / self.num_bits)

    def estimated_count(self) -> float:
        """Distinct keys inserted, estimated from the fill ratio (inf when full)."""
        fill = self.fill_ratio()
        if fill >= 1.0:
            return math.inf
        return -math.log1p(-fill) * self.num_bits / self._num_hashes

    def expected_fp_rate(self, n: int) -> float:
        """The expected false-positive rate after inserting `n` distinct keys."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return _fp_rate(n, self._num_blocks, self._num_hashes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BloomFilter):
            return NotImplemented
        return self._num_hashes == other._num_hashes and self._blocks == other._blocks

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"BloomFilter(num_bits={self.num_bits}, num_hashes={self._num_hashes}, "
            f"fill={self.fill_ratio():.3f})"
        )
