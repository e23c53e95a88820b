"""Content-defined block-hash chain over token ids, identical in every process.

A prompt is cut into blocks of `block_size` tokens; only full blocks are hashed. Block i's
hash covers the previous block's hash and its own tokens, so a hash names the whole prefix
up to and including that block. Hashes are 64-bit ints from blake2b (digest_size=8), seeded
by the model id and block size so that different models or block sizes never share a hash.
Python's `hash()` is never used: it differs between processes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16  # vLLM/SGLang's granularity: fine enough to reuse, coarse enough to index
MAX_BLOCK_SIZE = 1024  # a bound on one hash input; larger blocks would rarely be full
MAX_TOKEN_ID = 0xFFFF_FFFF  # token ids are hashed as uint32 little-endian
_SEED_DOMAIN = b"prefixswarm/blocks/1"  # versioned, so a future scheme never collides
_SALT_DOMAIN = b"prefixswarm/cache-salt/1"
MAX_SALT_BYTES = 1024  # a cache salt is an opaque secret; hashed once per request


class BlockHasher:
    """Computes the block-hash chain of token sequences for one model and block size."""

    __slots__ = ("_block_size", "_model_id", "_seed", "_seed_bytes")

    def __init__(self, model_id: str, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if not model_id:
            raise ValueError("model_id must be a non-empty string")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        self._model_id = model_id
        self._block_size = block_size
        material = b"\0".join((_SEED_DOMAIN, model_id.encode("utf-8"), str(block_size).encode()))
        self._seed_bytes = hashlib.blake2b(material, digest_size=8).digest()
        self._seed = int.from_bytes(self._seed_bytes, "little")

    @property
    def model_id(self) -> str:
        """The model id the chain is seeded with."""
        return self._model_id

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def seed(self) -> int:
        """The chain's starting value: the 'previous hash' of the first block."""
        return self._seed

    def salted_seed(self, salt: bytes) -> int:
        """The chain's starting value for a private request: keyed by `salt`, so nobody
        without the salt can compute (or match) the hashes of its blocks."""
        if not isinstance(salt, bytes) or not 1 <= len(salt) <= MAX_SALT_BYTES:
            raise ValueError(f"a cache salt is 1 to {MAX_SALT_BYTES} bytes")
        key = hashlib.blake2b(salt, digest_size=32, person=b"prefixswarm-salt").digest()
        digest = hashlib.blake2b(_SALT_DOMAIN + self._seed_bytes, key=key, digest_size=8)
        return int.from_bytes(digest.digest(), "little")

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many full blocks `num_tokens` tokens make."""
        return num_tokens // self._block_size

    def chain(self, tokens: Sequence[int], salt: bytes | None = None) -> list[int]:
        """One 64-bit hash per FULL block of `tokens`; a trailing partial block is ignored.

        With a `salt`, the chain starts from `salted_seed(salt)` (a private request)."""
        bs = self._block_size
        n_blocks = len(tokens) // bs
        out: list[int] = []
        prev = self._seed_bytes if salt is None else self.salted_seed(salt).to_bytes(8, "little")
        fmt = f"<{bs}I"
        for b in range(n_blocks):
            block = tokens[b * bs : (b + 1) * bs]
            try:
                payload = struct.pack(fmt, *block)
            except struct.error:
                bad = next((t for t in block if not (0 <= int(t) <= MAX_TOKEN_ID)), None)
                raise ValueError(f"token id {bad!r} is outside [0, {MAX_TOKEN_ID}]") from None
            prev = hashlib.blake2b(prev + payload, digest_size=8).digest()
            out.append(int.from_bytes(prev, "little"))
        return out

    def extend(self, prev_hash: int | None, block: Sequence[int]) -> int:
        """The hash of one full `block` following a block whose hash is `prev_hash`.

        `prev_hash=None` (or the seed) means the block is the first one.
        """
        if len(block) != self._block_size:
            raise ValueError(f"a block holds exactly {self._block_size} tokens, got {len(block)}")
        prev = self._seed_bytes if prev_hash is None else prev_hash.to_bytes(8, "little")
        try:
            payload = struct.pack(f"<{self._block_size}I", *block)
        except struct.error:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]") from None
        return int.from_bytes(hashlib.blake2b(prev + payload, digest_size=8).digest(), "little")
