"""CacheSummary: what a peer gossips about its cache, load and speed; CBOR codec.

One CBOR map with the key ``"v"`` and the field names of `CacheSummary`. Version 1 has
neither BATCH_FIELDS nor SOFTWARE_FIELDS, version 2 adds BATCH_FIELDS, version 3 both
(the sender's software version, and `leaving` in the last summary of a peer that stops).
A summary is sent at the lowest version that carries its values; all three are read.
`decode_summary` raises only `RemoteProtocolError`; a `CacheSummary` with out-of-bounds
values raises ValueError, so a summary object is valid wherever it came from.
docs/protocol.md 5.1 has the format and the producer's contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from protocols.bloom import BLOCK_BITS, MAX_BLOOM_BITS, MAX_BLOOM_HASHES, BloomFilter
from protocols.errors import RemoteProtocolError
from protocols.framing import decode_cbor, encode_cbor
from protocols.ids import validate_model_id

__all__ = [
    "BATCH_FIELDS",
    "MAX_BLOCK_SIZE",
    "MAX_COUNT",
    "MAX_PEER_ID_CHARS",
    "MAX_SEQ",
    "MAX_SUMMARY_BYTES",
    "MAX_TOKENS_PER_S",
    "SOFTWARE_FIELDS",
    "CacheSummary",
    "decode_summary",
    "encode_summary",
]

BATCH_VERSION = 2  # the first version with BATCH_FIELDS (1 is read too)
SOFTWARE_VERSION = 3  # the newest version, the first with SOFTWARE_FIELDS
MAX_SOFTWARE_CHARS = 48  # "prefixswarm/0.1.0+local.abc": a name and a version
_SOFTWARE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._+/-")
# Fields other than the filter take < 600 bytes; 4 KiB leaves room without allowing junk.
MAX_SUMMARY_BYTES = MAX_BLOOM_BITS // 8 + 4096
# Base58 ids of ed25519 keys have 52 characters, of RSA keys ~46; 128 is generous.
MAX_PEER_ID_CHARS = 128
MAX_BLOCK_SIZE = 1024  # the same bound as PeerConfig.block_size
MAX_SEQ = (1 << 63) - 1  # a signed 64-bit counter: fits every CBOR and SQL integer type
# Block and token counts: 2^40 is ~10^12, far beyond any cache or queue, and keeps
# sums of counts over all peers exact in a float.
MAX_COUNT = 1 << 40
MAX_TOKENS_PER_S = 1e9  # no device comes near; rejects absurd claims that would win routing

MAX_BATCH_SLOTS = 1 << 16  # far above any batch a device runs; bounds a stranger's claim
_FLOAT_FIELDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "batch_decode_tokens_per_s")
# What the cost model needs of a batching peer (docs/cost-model.md), each with its default
# for a summary that lacks it (version 1, or a peer that does not batch).
BATCH_FIELDS = ("waiting_requests", "batch_slots", "batch_decode_tokens_per_s", "step_tokens")
SOFTWARE_FIELDS = ("software", "leaving")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class CacheSummary:
    """One peer's cache summary. Construction validates every bound (ValueError/TypeError)."""

    peer_id: str
    model_id: str
    block_size: int
    seq: int
    bloom_bits: int
    bloom_hashes: int
    bloom: bytes
    cached_blocks: int
    capacity_blocks: int
    queued_prompt_tokens: int
    running_requests: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # one stream's decode speed at the batch it was measured in
    # Batch fields (BATCH_FIELDS; version 2). batch_slots = 0: the peer does not batch.
    waiting_requests: int = 0  # requests not admitted into the batch yet (all slots taken)
    batch_slots: int = 0  # requests the peer decodes in one step at most (max_running)
    batch_decode_tokens_per_s: float = 0.0  # all streams together, at the current batch size
    step_tokens: int = 0  # tokens one step computes at most (decodes + prefill chunks)
    # Software fields (SOFTWARE_FIELDS; version 3).
    software: str = ""  # the sender's software and version ("prefixswarm/0.1.0"); "" unsaid
    leaving: bool = False  # the sender stops: drop it now, not after 3 silent intervals

    def __post_init__(self) -> None:
        if type(self.peer_id) is not str or not 1 <= len(self.peer_id) <= MAX_PEER_ID_CHARS:
            raise ValueError(f"peer_id must be a str of 1..{MAX_PEER_ID_CHARS} characters")
        if not self.peer_id.isascii() or not self.peer_id.isalnum():
            raise ValueError("peer_id must be ASCII letters and digits (base58 or base32)")
        validate_model_id(self.model_id)
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _check_int("seq", self.seq, 0, MAX_SEQ)
        _check_int("bloom_bits", self.bloom_bits, BLOCK_BITS, MAX_BLOOM_BITS)
        if self.bloom_bits % BLOCK_BITS:
            raise ValueError(f"bloom_bits must be a multiple of {BLOCK_BITS}")
        _check_int("bloom_hashes", self.bloom_hashes, 1, MAX_BLOOM_HASHES)
        if type(self.bloom) is not bytes:
            raise TypeError(f"bloom must be bytes, got {type(self.bloom).__name__}")
        if len(self.bloom) != self.bloom_bits // 8:
            raise ValueError(
                f"bloom has {len(self.bloom)} bytes, {self.bloom_bits} bits need "
                f"{self.bloom_bits // 8}"
            )
        for name in ("cached_blocks", "capacity_blocks", "queued_prompt_tokens"):
            _check_int(name, getattr(self, name), 0, MAX_COUNT)
        _check_int("running_requests", self.running_requests, 0, MAX_COUNT)
        _check_int("waiting_requests", self.waiting_requests, 0, MAX_COUNT)
        _check_int("batch_slots", self.batch_slots, 0, MAX_BATCH_SLOTS)
        _check_int("step_tokens", self.step_tokens, 0, MAX_COUNT)
        if type(self.software) is not str or len(self.software) > MAX_SOFTWARE_CHARS or not (
            set(self.software) <= _SOFTWARE_CHARS
        ):
            raise ValueError(
                f"software must be at most {MAX_SOFTWARE_CHARS} characters of [A-Za-z0-9._+/-]"
            )
        if type(self.leaving) is not bool:
            raise TypeError(f"leaving must be a bool, got {type(self.leaving).__name__}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) not in (int, float):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and 0.0 <= value <= MAX_TOKENS_PER_S):
                raise ValueError(f"{name} must be finite, in [0, {MAX_TOKENS_PER_S:g}]: {value}")

    def bloom_filter(self) -> BloomFilter:
        """A new BloomFilter decoded from `bloom` (the caller may keep and reuse it)."""
        return BloomFilter.from_bytes(self.bloom_bits, self.bloom_hashes, self.bloom)


_KEYS = frozenset({"v", *(f.name for f in fields(CacheSummary))})
_KEYS_BY_VERSION = {
    1: _KEYS - frozenset(BATCH_FIELDS) - frozenset(SOFTWARE_FIELDS),
    BATCH_VERSION: _KEYS - frozenset(SOFTWARE_FIELDS),
    SOFTWARE_VERSION: _KEYS,
}
_DEFAULTS = {f.name: f.default for f in fields(CacheSummary)}


def _says(summary: CacheSummary, names: tuple[str, ...]) -> bool:
    return any(getattr(summary, name) != _DEFAULTS[name] for name in names)


def encode_summary(summary: CacheSummary) -> bytes:
    """The CBOR wire form of `summary`, at the lowest version that carries its values."""
    if _says(summary, SOFTWARE_FIELDS):
        version = SOFTWARE_VERSION
    else:
        version = BATCH_VERSION if _says(summary, BATCH_FIELDS) else 1
    keys = _KEYS_BY_VERSION[version]
    wire: dict[str, object] = {"v": version}
    for f in fields(CacheSummary):
        if f.name not in keys:
            continue
        value = getattr(summary, f.name)
        wire[f.name] = float(value) if f.name in _FLOAT_FIELDS else value
    data = encode_cbor(wire)
    if len(data) > MAX_SUMMARY_BYTES:  # cannot happen for a valid summary; guards edits
        raise ValueError(f"summary of {len(data)} bytes exceeds {MAX_SUMMARY_BYTES}")
    return data


def decode_summary(data: bytes | bytearray | memoryview) -> CacheSummary:
    """A CacheSummary from wire bytes; RemoteProtocolError for anything invalid."""
    if len(data) > MAX_SUMMARY_BYTES:
        raise RemoteProtocolError(f"summary of {len(data)} bytes exceeds {MAX_SUMMARY_BYTES}")
    wire = decode_cbor(data)
    if not isinstance(wire, dict):
        raise RemoteProtocolError(f"summary must be a CBOR map, got {type(wire).__name__}")
    version = wire.get("v")
    if type(version) is not int or version not in _KEYS_BY_VERSION:
        raise RemoteProtocolError(f"unsupported summary version {version!r}")
    keys = _KEYS_BY_VERSION[version]
    if wire.keys() != keys:
        missing = sorted(keys - wire.keys())
        extra = sorted(map(repr, wire.keys() - keys))
        raise RemoteProtocolError(f"summary keys wrong: missing {missing}, unexpected {extra}")
    values = {name: value for name, value in wire.items() if name != "v"}
    for name in _FLOAT_FIELDS:  # CBOR may carry an integral rate as an int
        if name in values and type(values[name]) is int:
            values[name] = float(values[name])
    try:
        return CacheSummary(**values)
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"invalid summary: {exc}") from exc
