"""The served-for protocol /prefixswarm/served/1.0.0: did this peer ask you for this prompt?

A peer on probation earns trust with answers an entry compares with the answer it
delivered to its client. A peer that forwards those requests to an honest peer and
relays the answer (laundering) would pass without running the model. So before it
credits a matching answer, the entry asks a few other peers one `ServedQuery`: did the
probation peer ask you, recently, for a prompt with this digest? One `ServedReply`
answers it. The digest (`prompt_digest`) is of the prompt's token ids alone: an answer
cannot be had for another prompt, and the query shows the answering peer nothing it
could not already have been asked. Parsers raise only ``RemoteProtocolError``; unknown
keys are ignored.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from protocols.errors import RemoteProtocolError
from protocols.framing import message_map
from protocols.roots import valid_peer_id

__all__ = [
    "DIGEST_BYTES",
    "KIND_SERVED_QUERY",
    "KIND_SERVED_REPLY",
    "MAX_SERVED_FRAME_BYTES",
    "SERVED_VERSION",
    "ServedQuery",
    "ServedReply",
    "decode_served_query",
    "decode_served_reply",
    "prompt_digest",
]

SERVED_VERSION = 1
KIND_SERVED_QUERY = "served_query"
KIND_SERVED_REPLY = "served_reply"
DIGEST_BYTES = 32  # SHA-256
MAX_SERVED_FRAME_BYTES = 512  # a digest and a peer id: ~110 bytes of CBOR


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the token ids, each as 4 little-endian bytes (ids are < 2**32)."""
    return hashlib.sha256(struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)).digest()


@dataclass(frozen=True)
class ServedQuery:
    """Did `requester` ask you for the prompt of `digest` (recently)?"""

    digest: bytes
    requester: str

    def __post_init__(self) -> None:
        if type(self.digest) is not bytes or len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"digest must be {DIGEST_BYTES} bytes")
        if not valid_peer_id(self.requester):
            raise ValueError("requester must be a peer id")

    def to_wire(self) -> dict[str, object]:
        return {"t": KIND_SERVED_QUERY, "v": SERVED_VERSION, "digest": self.digest,
                "requester": self.requester}


@dataclass(frozen=True)
class ServedReply:
    """Whether it did."""

    asked: bool

    def __post_init__(self) -> None:
        if type(self.asked) is not bool:
            raise ValueError("asked must be a bool")

    def to_wire(self) -> dict[str, object]:
        return {"t": KIND_SERVED_REPLY, "v": SERVED_VERSION, "asked": self.asked}


def _mapping(obj: object, kind: str) -> dict[object, object]:
    return message_map(obj, kind, SERVED_VERSION, "served")


def decode_served_query(obj: object) -> ServedQuery:
    """A query from a decoded frame (the answering side's first frame)."""
    mapping = _mapping(obj, KIND_SERVED_QUERY)
    try:
        return ServedQuery(mapping["digest"], mapping["requester"])  # type: ignore[arg-type]
    except KeyError as exc:
        raise RemoteProtocolError(f"served query lacks {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"invalid served query: {exc}") from exc


def decode_served_reply(obj: object) -> ServedReply:
    """A reply from a decoded frame; RemoteProtocolError for anything invalid."""
    mapping = _mapping(obj, KIND_SERVED_REPLY)
    try:
        return ServedReply(mapping["asked"])  # type: ignore[arg-type]
    except KeyError as exc:
        raise RemoteProtocolError(f"served reply lacks {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"invalid served reply: {exc}") from exc
