"""BloomBank: many Bloom filters of one shape, tested against a key chain all at once (numpy).

A routing decision asks every peer's filter how many leading blocks of a prompt's chain
it holds; one filter at a time in CPython (~0.15 us a probe, ~3 us to mix a key) that
dominated a decision at 64 peers. The bank stores the filters bit-sliced (row `g` holds
bit `g` of every filter), so a chain costs a few dozen numpy calls whatever the number
of filters. Writes are deferred to the next `prefix_counts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from protocols.bloom import BLOCK_BITS, KEY_SEED, MAX_BLOOM_BITS, MAX_BLOOM_HASHES, POSITION_SEED

__all__ = ["MAX_BANK_SLOTS", "BloomBank", "KeyChain"]

U64 = npt.NDArray[np.uint64]

# A bank's matrix grows 64 slots at a time; 1024 slots (16 words a row) is 4x PeerTable's
# MAX_PEERS, enough for any table while bounding a bank at 16 * 8 bytes * MAX_BLOOM_BITS.
MAX_BANK_SLOTS = 1024
_WORD = 64
_CHUNKS_PER_MIX = 7  # 9-bit positions per mixed 64-bit word (as in protocols/bloom.py)
_M32 = np.uint64(0xFFFF_FFFF)
_S32 = np.uint64(32)
_POS_MASK = np.uint64(BLOCK_BITS - 1)
_BLOCK_SHIFT = np.uint64(BLOCK_BITS.bit_length() - 1)
_KEY_SEED = np.uint64(KEY_SEED)
_MIX_SEEDS = np.uint64(POSITION_SEED) + np.arange(
    0, MAX_BLOOM_HASHES, _CHUNKS_PER_MIX, dtype=np.uint64
)  # the words whose 9-bit chunks give positions 0-6, 7-13, 14-15
_CHUNK_SHIFTS = np.arange(0, 9 * _CHUNKS_PER_MIX, 9, dtype=np.uint64)
# A flush writes the slots of one word together from this many changed slots on (the
# bit transpose of 64 filters costs about as much as 8 single-slot writes).
_BATCH_FROM = 8


def _mix64(x: U64) -> U64:
    """protocols.bloom.mix64 element-wise (uint64 arithmetic wraps like the `& _M64`)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class KeyChain:
    """A chain of 64-bit keys mixed once (numpy), to be tested against several banks."""

    __slots__ = ("_hashes", "_positions")

    def __init__(self, keys: Sequence[int]) -> None:
        """ValueError unless every key is an int in the unsigned 64-bit range."""
        for key in keys:
            if type(key) is not int:
                raise ValueError(f"Bloom keys are 64-bit ints, got {type(key).__name__}")
        try:
            array = np.array(keys, dtype=np.uint64).reshape(len(keys))
        except OverflowError:
            raise ValueError("a Bloom key is out of the unsigned 64-bit range") from None
        self._hashes: U64 = _mix64(array ^ _KEY_SEED)
        self._positions: dict[int, npt.NDArray[Any]] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def positions(self, num_hashes: int) -> npt.NDArray[Any]:
        """In-block bit positions, shape (len, num_hashes), as protocols.bloom._mask sets."""
        found = self._positions.get(num_hashes)
        if found is None:
            mixes = -(-num_hashes // _CHUNKS_PER_MIX)
            words = _mix64(self._hashes[:, None] ^ _MIX_SEEDS[None, :mixes])
            chunks = (words[:, :, None] >> _CHUNK_SHIFTS) & _POS_MASK
            found = chunks.reshape(len(self._hashes), mixes * _CHUNKS_PER_MIX)[:, :num_hashes]
            self._positions[num_hashes] = found
        return found

    def rows(self, num_blocks: int, num_hashes: int) -> npt.NDArray[Any]:
        """Global bit index of each key's positions in a filter of `num_blocks` blocks."""
        # (h * num_blocks) >> 64 without 128-bit ints: num_blocks < 2**32, so neither
        # partial product overflows and the sum stays below 2**64.
        h, n = self._hashes, np.uint64(num_blocks)
        block = ((h >> _S32) * n + (((h & _M32) * n) >> _S32)) >> _S32
        rows: npt.NDArray[Any] = (block << _BLOCK_SHIFT)[:, None] + self.positions(num_hashes)
        return rows


_T8_STEPS = tuple(
    (np.uint64(shift), np.uint64(mask))
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0))
)


def _transpose_64(rows: npt.NDArray[np.uint8]) -> U64:
    """Bit `s` of word `g` is bit `g` of filter row `s`, for 64 rows of filter bytes.

    Each byte column of 8 rows is an 8x8 bit matrix: gathered into one uint64 (row k
    in byte k), transposed with the three swap steps of Hacker's Delight's transpose8
    (element-wise over every such matrix at once), and scattered back so that byte j
    of word 8b + i holds bit i of byte b of rows 8j .. 8j+7.
    """
    nbytes = rows.shape[1]
    by_row = rows.reshape(8, 8, nbytes)  # (j, k, byte): row 8j + k
    gathered = np.empty((8, nbytes, 8), dtype=np.uint8)  # (j, byte, k)
    for k in range(8):
        gathered[:, :, k] = by_row[:, k, :]
    x = gathered.view("<u8").reshape(8, nbytes)
    for shift, mask in _T8_STEPS:
        t = (x ^ (x >> shift)) & mask
        x = x ^ t ^ (t << shift)
    spread = x.astype("<u8", copy=False).view(np.uint8).reshape(8, nbytes, 8)  # (j, byte, i)
    out = np.empty((nbytes, 8, 8), dtype=np.uint8)  # (byte, i, j): word 8 byte + i
    for j in range(8):
        out[:, :, j] = spread[j]
    words: U64 = out.view("<u8").reshape(nbytes * 8)
    return words


class BloomBank:
    """Filters of one shape, in numbered slots, answering prefix counts for all at once."""

    __slots__ = ("_bits", "_free", "_num_blocks", "_num_hashes", "_pending", "_used")

    def __init__(self, num_bits: int, num_hashes: int) -> None:
        if not (BLOCK_BITS <= num_bits <= MAX_BLOOM_BITS and num_bits % BLOCK_BITS == 0):
            raise ValueError(f"num_bits must be a multiple of {BLOCK_BITS} up to {MAX_BLOOM_BITS}")
        if not 1 <= num_hashes <= MAX_BLOOM_HASHES:
            raise ValueError(f"num_hashes must be in [1, {MAX_BLOOM_HASHES}], got {num_hashes}")
        self._num_blocks = num_bits // BLOCK_BITS
        self._num_hashes = num_hashes
        self._bits: U64 = np.zeros((num_bits, 1), dtype=np.uint64)
        self._used: set[int] = set()
        self._free: list[int] = []  # released slots, reused before new ones
        self._pending: dict[int, bytes | None] = {}  # slot -> its new filter bytes, or cleared

    @property
    def num_bits(self) -> int:
        return self._num_blocks * BLOCK_BITS

    @property
    def num_hashes(self) -> int:
        return self._num_hashes

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._used)

    @property
    def nbytes(self) -> int:
        """Bytes the matrix takes once every slot handed out is stored (64 per word)."""
        slots = len(self._used) + len(self._free)
        return self.num_bits // 8 * _WORD * -(-slots // _WORD)

    def acquire(self) -> int:
        """A free slot (empty filter); ValueError beyond MAX_BANK_SLOTS."""
        if self._free:
            slot = self._free.pop()
        elif len(self._used) < MAX_BANK_SLOTS:
            slot = len(self._used)
        else:
            raise ValueError(f"a bank holds at most {MAX_BANK_SLOTS} filters")
        self._used.add(slot)
        return slot

    def put(self, slot: int, data: bytes) -> None:
        """Store a filter's bytes (`BloomFilter.to_bytes` layout) in `slot`; applied lazily."""
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not in use")
        if len(data) * 8 != self.num_bits:
            raise ValueError(f"a {self.num_bits}-bit filter needs {self.num_bits // 8} bytes")
        self._pending[slot] = data

    def release(self, slot: int) -> None:
        """Empty `slot` and make it reusable (ignored if not in use)."""
        if slot in self._used:
            self._used.discard(slot)
            self._free.append(slot)
            self._pending[slot] = None

    def _flush(self) -> None:
        words = -(-(max(self._pending) + 1) // _WORD)
        if words > self._bits.shape[1]:
            grown = np.zeros((self._bits.shape[0], words), dtype=np.uint64)
            grown[:, : self._bits.shape[1]] = self._bits
            self._bits = grown
        by_word: dict[int, list[tuple[int, bytes | None]]] = {}
        for slot, data in self._pending.items():
            word, bit = divmod(slot, _WORD)
            by_word.setdefault(word, []).append((bit, data))
        for word, changes in by_word.items():
            column = self._bits[:, word]  # a view: updated in place
            if len(changes) < _BATCH_FROM:
                for bit, data in changes:
                    column &= ~np.uint64(1 << bit)
                    if data is not None:
                        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
                        column |= bits.astype(np.uint64) << np.uint64(bit)
                continue
            # Many slots of one word (a simulated swarm: every peer's table takes every
            # summary): write them in one pass over the word's column (_transpose_64).
            rows = np.zeros((_WORD, self.num_bits // 8), dtype=np.uint8)
            cleared = 0
            for bit, data in changes:
                cleared |= 1 << bit
                if data is not None:
                    rows[bit] = np.frombuffer(data, dtype=np.uint8)
            column &= ~np.uint64(cleared)
            column |= _transpose_64(rows)
        self._pending.clear()

    def prefix_counts(self, chain: KeyChain) -> list[int]:
        """For every slot, how many leading keys of `chain` its filter holds.

        Exactly `BloomFilter.count_prefix` of the slot's filter (the walk until the first
        miss); free slots answer 0. Indexed by slot, at least as long as the highest slot.
        """
        if self._pending:
            self._flush()
        slots = self._bits.shape[1] * _WORD
        if len(chain) == 0:
            return [0] * slots
        rows = chain.rows(self._num_blocks, self._num_hashes)
        held = np.bitwise_and.reduce(self._bits[rows], axis=1)  # (keys, words): who holds key
        alive = np.bitwise_and.accumulate(held, axis=0)  # who holds every key up to here
        as_bytes = alive.astype("<u8", copy=False).view(np.uint8)
        survived = np.unpackbits(as_bytes, axis=1, bitorder="little").sum(axis=0, dtype=np.intp)
        counts: list[int] = survived.tolist()
        return counts
