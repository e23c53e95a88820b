"""The prefix-root protocol /prefixswarm/roots/1.0.0: provider records and summaries on demand.

Gossip mode `ring`: beyond its neighbours, a peer finds the holders of a prompt's prefix
root at the root's home peers. One request per stream, one CBOR map per frame: `Announce`
/ `Ack` (holder -> home), `Find` / `Providers` (entry -> home), `Match` / `Matched` and
`SummaryQuery` / `SummaryReply` (entry -> holder); every answer is a claim the asker checks.
Decoders raise only `RemoteProtocolError`; docs/protocol.md 5.5 has the format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocols.errors import RemoteProtocolError
from protocols.summary import MAX_PEER_ID_CHARS, MAX_SUMMARY_BYTES

__all__ = [
    "KIND_ACK",
    "KIND_ANNOUNCE",
    "KIND_FIND",
    "KIND_MATCH",
    "KIND_MATCHED",
    "KIND_PROVIDERS",
    "KIND_SUMMARY",
    "KIND_SUMMARY_QUERY",
    "MAX_MATCH_BLOCKS",
    "MAX_PROVIDERS_PER_REPLY",
    "MAX_REPLY_FRAME_BYTES",
    "MAX_REQUEST_FRAME_BYTES",
    "MAX_ROOTS_PER_ANNOUNCE",
    "ROOTS_VERSION",
    "Ack",
    "Announce",
    "Find",
    "Match",
    "Matched",
    "Providers",
    "SummaryQuery",
    "SummaryReply",
    "decode_ack",
    "decode_matched",
    "decode_providers",
    "decode_request",
    "decode_summary_reply",
    "valid_peer_id",
]

ROOTS_VERSION = 1
KIND_ANNOUNCE = "announce"
KIND_ACK = "ack"
KIND_FIND = "find"
KIND_PROVIDERS = "providers"
KIND_MATCH = "match"
KIND_MATCHED = "matched"
KIND_SUMMARY_QUERY = "summary_query"
KIND_SUMMARY = "summary"
# Roots per list of one announcement: a cache of 1,456 blocks holds at most that many
# roots, and an announcer splits larger batches; 512 x 9 bytes x 2 lists fits 16 KiB.
MAX_ROOTS_PER_ANNOUNCE = 512
MAX_REQUEST_FRAME_BYTES = 16 << 10
# Provider ids per reply: the home keeps 16 per root (peer/swarm/providers.py), an entry asks 2.
MAX_PROVIDERS_PER_REPLY = 16
# Blocks of a chain one Match carries: 8,192 tokens at 16 per block, enough to rank
# holders (4.6 KB of CBOR).
MAX_MATCH_BLOCKS = 512
# The largest reply is a summary (at most MAX_SUMMARY_BYTES) plus a few keys.
MAX_REPLY_FRAME_BYTES = MAX_SUMMARY_BYTES + 1024
_MAX_ROOT = (1 << 64) - 1  # a root is a 64-bit chain hash (protocols/blocks.py)


def valid_peer_id(value: object) -> bool:
    """A peer id as summaries carry it: 1..128 ASCII letters and digits (base58/base32)."""
    return (
        type(value) is str
        and 1 <= len(value) <= MAX_PEER_ID_CHARS
        and value.isascii()
        and value.isalnum()
    )


def _check_roots(name: str, roots: Sequence[int]) -> tuple[int, ...]:
    if len(roots) > MAX_ROOTS_PER_ANNOUNCE:
        raise ValueError(f"{name}: at most {MAX_ROOTS_PER_ANNOUNCE} roots, got {len(roots)}")
    for root in roots:
        if type(root) is not int or not 0 <= root <= _MAX_ROOT:
            raise ValueError(f"{name}: a root is a 64-bit unsigned int, got {root!r}")
    return tuple(roots)


def _check_count(name: str, value: object, high: int) -> None:
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"{name} must be in [0, {high}], got {value!r}")


def _check_root(root: object) -> int:
    if type(root) is not int or not 0 <= root <= _MAX_ROOT:
        raise ValueError(f"a root is a 64-bit unsigned int, got {root!r}")
    return root


def _header(kind: str) -> dict[str, object]:
    return {"t": kind, "v": ROOTS_VERSION}


@dataclass(frozen=True)
class Announce:
    """The sender holds `add` now and no longer holds `drop`."""

    add: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "add", _check_roots("add", self.add))
        object.__setattr__(self, "drop", _check_roots("drop", self.drop))

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_ANNOUNCE), "add": list(self.add), "drop": list(self.drop)}


@dataclass(frozen=True)
class Ack:
    """How many roots of an Announce's `add` the home recorded (its bounds may refuse)."""

    kept: int

    def __post_init__(self) -> None:
        _check_count("kept", self.kept, MAX_ROOTS_PER_ANNOUNCE)

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_ACK), "kept": self.kept}


@dataclass(frozen=True)
class Find:
    """Who holds `root`?"""

    root: int

    def __post_init__(self) -> None:
        _check_root(self.root)

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_FIND), "root": self.root}


@dataclass(frozen=True)
class Providers:
    """The peers that announced `root`, most recent first (claims, not facts)."""

    root: int
    peers: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_root(self.root)
        if len(self.peers) > MAX_PROVIDERS_PER_REPLY:
            raise ValueError(f"at most {MAX_PROVIDERS_PER_REPLY} providers, got {len(self.peers)}")
        for peer in self.peers:
            if not valid_peer_id(peer):
                raise ValueError(f"not a peer id: {peer!r}")
        object.__setattr__(self, "peers", tuple(self.peers))

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_PROVIDERS), "root": self.root, "peers": list(self.peers)}


@dataclass(frozen=True)
class Match:
    """How many leading blocks of `chain` do you hold?"""

    chain: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.chain) > MAX_MATCH_BLOCKS:
            raise ValueError(f"at most {MAX_MATCH_BLOCKS} blocks, got {len(self.chain)}")
        for key in self.chain:
            _check_root(key)
        object.__setattr__(self, "chain", tuple(self.chain))

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_MATCH), "chain": list(self.chain)}


@dataclass(frozen=True)
class Matched:
    """The leading blocks of the asked chain the holder says it holds."""

    blocks: int

    def __post_init__(self) -> None:
        _check_count("blocks", self.blocks, MAX_MATCH_BLOCKS)

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_MATCHED), "blocks": self.blocks}


@dataclass(frozen=True)
class SummaryQuery:
    """Send me your last published summary. (No fields: the stream is the question.)"""

    def to_wire(self) -> dict[str, object]:
        return _header(KIND_SUMMARY_QUERY)


@dataclass(frozen=True)
class SummaryReply:
    """The holder's last published summary (protocols/summary.py bytes); empty: none yet."""

    data: bytes

    def __post_init__(self) -> None:
        if type(self.data) is not bytes or len(self.data) > MAX_SUMMARY_BYTES:
            raise ValueError(f"data must be bytes of at most {MAX_SUMMARY_BYTES}")

    def to_wire(self) -> dict[str, object]:
        return {**_header(KIND_SUMMARY), "data": self.data}


Request = Announce | Find | Match | SummaryQuery


def _mapping(obj: object, kinds: Sequence[str]) -> tuple[str, dict[object, object]]:
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"a roots message must be a CBOR map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != ROOTS_VERSION:
        raise RemoteProtocolError(f"unsupported roots message version {version!r}")
    kind = obj.get("t")
    if kind not in kinds:
        raise RemoteProtocolError(f"expected a {' or '.join(kinds)} message, got {kind!r}")
    return str(kind), obj


def _field(mapping: dict[object, object], key: str) -> object:
    try:
        return mapping[key]
    except KeyError:
        raise RemoteProtocolError(f"{mapping.get('t')} message lacks {key!r}") from None


def _roots_field(mapping: dict[object, object], key: str) -> tuple[int, ...]:
    value = mapping.get(key, [])
    if not isinstance(value, list):
        raise RemoteProtocolError(f"{key!r} must be an array of roots")
    try:
        return _check_roots(key, value)
    except ValueError as exc:
        raise RemoteProtocolError(str(exc)) from exc


def decode_request(obj: object) -> Request:
    """The first frame on a stream, as its answerer reads it."""
    kind, mapping = _mapping(obj, (KIND_ANNOUNCE, KIND_FIND, KIND_MATCH, KIND_SUMMARY_QUERY))
    if kind == KIND_ANNOUNCE:
        return Announce(_roots_field(mapping, "add"), _roots_field(mapping, "drop"))
    try:
        if kind == KIND_FIND:
            return Find(_check_root(_field(mapping, "root")))
        if kind == KIND_MATCH:
            chain = _field(mapping, "chain")
            if not isinstance(chain, list):
                raise ValueError("'chain' must be an array of block hashes")
            return Match(tuple(chain))
    except ValueError as exc:
        raise RemoteProtocolError(str(exc)) from exc
    return SummaryQuery()


def decode_ack(obj: object) -> Ack:
    _, mapping = _mapping(obj, (KIND_ACK,))
    try:
        return Ack(_field(mapping, "kept"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise RemoteProtocolError(f"invalid ack: {exc}") from exc


def decode_matched(obj: object, asked: Match) -> Matched:
    """A reply to `asked`: at most the blocks it asked about."""
    _, mapping = _mapping(obj, (KIND_MATCHED,))
    try:
        matched = Matched(_field(mapping, "blocks"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise RemoteProtocolError(f"invalid match reply: {exc}") from exc
    if matched.blocks > len(asked.chain):
        raise RemoteProtocolError(f"matched {matched.blocks} of {len(asked.chain)} blocks")
    return matched


def decode_providers(obj: object, root: int) -> Providers:
    """A reply to `Find(root)`: it must name the root asked about; duplicates dropped."""
    _, mapping = _mapping(obj, (KIND_PROVIDERS,))
    got = _field(mapping, "root")
    if got != root or type(got) is not int:
        raise RemoteProtocolError(f"providers of root {got!r}, asked about {root}")
    peers = _field(mapping, "peers")
    if not isinstance(peers, list):
        raise RemoteProtocolError("'peers' must be an array of peer ids")
    try:
        return Providers(root, tuple(dict.fromkeys(peers)))
    except (TypeError, ValueError) as exc:  # TypeError: an unhashable item (a map)
        raise RemoteProtocolError(f"invalid providers: {exc}") from exc


def decode_summary_reply(obj: object) -> SummaryReply:
    _, mapping = _mapping(obj, (KIND_SUMMARY,))
    try:
        return SummaryReply(_field(mapping, "data"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise RemoteProtocolError(f"invalid summary reply: {exc}") from exc
