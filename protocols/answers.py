"""Signed answers and the evidence a wrong one makes (pure; no keys, no I/O).

A serving peer signs every answer it finishes: its libp2p key signs `signed_bytes`, a
digest of (its own peer id, the request's digest, the answer's token ids, how it
finished), carried in the `InferResult`. Whoever holds the request and the answer can
check the signature against the server's public key (its peer id embeds it).

`Evidence` is what an entry that verified a wrong answer sends to other peers on
/prefixswarm/evidence/1.0.0: the request, the answer and the accused's signature over
both. A receiver checks the signature, then re-scores the answer with its own model; only
an answer that the accused signed *and* that the receiver's own verifier rejects
quarantines it. Evidence cannot be forged against an honest peer: it needs that peer's
signature over an answer, and the answers an honest peer signs pass re-scoring.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protocols.errors import RemoteProtocolError
from protocols.framing import encode_cbor
from protocols.infer import (
    MAX_NEW_TOKENS,
    MAX_PEER_ID_LEN,
    FinishReason,
    InferRequest,
    parse_request,
)

__all__ = [
    "EVIDENCE_KIND",
    "MAX_SIGNATURE_LEN",
    "Evidence",
    "parse_evidence",
    "request_digest",
    "signed_bytes",
]

SIGNATURE_DOMAIN = b"prefixswarm/answer/1\x00"  # a signature here means nothing elsewhere
MAX_SIGNATURE_LEN = 128  # ed25519: 64 bytes; room for other libp2p key types
EVIDENCE_KIND = "evidence"


def request_digest(request: InferRequest) -> bytes:
    """SHA-256 of what decides an answer (prompt and sampling) and the request's id, so a
    signature answers one request; the deadline and hop count, set in transit, are out."""
    fields = [
        request.request_id, list(request.prompt_token_ids), request.max_new_tokens,
        float(request.temperature), float(request.top_p), request.seed, list(request.stop),
    ]
    return hashlib.sha256(encode_cbor(fields)).digest()


def signed_bytes(
    server_id: str, request: InferRequest, tokens: Sequence[int], finish: FinishReason
) -> bytes:
    """The bytes a server signs for its answer `tokens` to `request`."""
    body = encode_cbor([server_id, request_digest(request), list(tokens), finish.value])
    return SIGNATURE_DOMAIN + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class Evidence:
    """A signed answer of ``accused`` to ``request``, which the sender found wrong."""

    accused: str
    request: InferRequest
    answer: tuple[int, ...]
    finish_reason: FinishReason
    signature: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.accused, str) or not 1 <= len(self.accused) <= MAX_PEER_ID_LEN:
            raise ValueError("accused must be a peer id")
        if not isinstance(self.request, InferRequest):
            raise ValueError("request must be an InferRequest")
        if not isinstance(self.answer, tuple) or not 1 <= len(self.answer) <= MAX_NEW_TOKENS:
            raise ValueError(f"answer must hold 1 to {MAX_NEW_TOKENS} tokens")
        if any(type(t) is not int or t < 0 for t in self.answer):
            raise ValueError("answer must hold non-negative ints")
        if not isinstance(self.finish_reason, FinishReason):
            raise ValueError("finish_reason must be a FinishReason")
        if not isinstance(self.signature, bytes) or not 1 <= len(self.signature) <= (
            MAX_SIGNATURE_LEN
        ):
            raise ValueError(f"signature must be 1 to {MAX_SIGNATURE_LEN} bytes")

    def signed_bytes(self) -> bytes:
        return signed_bytes(self.accused, self.request, self.answer, self.finish_reason)

    def to_wire(self) -> dict[str, object]:
        return {
            "t": EVIDENCE_KIND,
            "accused": self.accused,
            "request": self.request.to_wire(),
            "answer": list(self.answer),
            "finish_reason": self.finish_reason.value,
            "sig": self.signature,
        }


def parse_evidence(obj: object, vocab_size: int) -> Evidence:
    """Evidence from a decoded frame; RemoteProtocolError if it is not well-formed."""
    if not isinstance(obj, Mapping) or obj.get("t") != EVIDENCE_KIND:
        raise RemoteProtocolError("not an evidence frame")
    answer = obj.get("answer")
    if not isinstance(answer, list | tuple) or len(answer) > MAX_NEW_TOKENS:
        raise RemoteProtocolError("evidence answer must be a list of tokens")
    request = parse_request(obj.get("request"), vocab_size)
    try:
        if any(type(t) is not int or not 0 <= t < vocab_size for t in answer):
            raise ValueError("answer tokens outside the vocabulary")
        accused, finish, sig = obj.get("accused"), obj.get("finish_reason"), obj.get("sig")
        if not isinstance(accused, str) or not isinstance(finish, str):
            raise ValueError("accused and finish_reason must be strings")
        if not isinstance(sig, bytes):
            raise ValueError("sig must be bytes")
        return Evidence(accused, request, tuple(answer), FinishReason(finish), sig)
    except ValueError as exc:
        raise RemoteProtocolError(f"invalid evidence: {exc}") from exc
