"""Signed answers with libp2p keys: a server signs each answer it finishes, an entry
checks the signature against the server's peer id (which embeds its public key), and the
evidence a wrong answer makes is checked the same way (protocols/answers.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from libp2p.peer.id import ID

from protocols.answers import Evidence, signed_bytes
from protocols.infer import FinishReason, InferRequest, InferResult

Signer = Callable[[bytes], bytes]  # a libp2p private key's sign


def sign_answer(
    sign: Signer, self_id: str, request: InferRequest, tokens: Sequence[int],
    finish: FinishReason,
) -> bytes:
    return sign(signed_bytes(self_id, request, tokens, finish))


def signature_valid(peer_id: str, message: bytes, signature: bytes) -> bool:
    """Whether `signature` over `message` is by the key of `peer_id` (False for an id
    whose key cannot be extracted, or any malformed input)."""
    if not signature:
        return False
    try:
        key = ID.from_base58(peer_id).extract_public_key()
        return key is not None and bool(key.verify(message, signature))
    except Exception:  # a malformed id, key or signature: the libraries raise many kinds
        return False


def answer_signed(
    peer_id: str, request: InferRequest, answer: Sequence[int], result: InferResult
) -> bool:
    """Whether `result` carries `peer_id`'s signature over `answer` to `request`."""
    message = signed_bytes(peer_id, request, answer, result.finish_reason)
    return signature_valid(peer_id, message, result.signature)


def evidence_signed(evidence: Evidence) -> bool:
    """Whether the accused itself signed the answer the evidence carries."""
    return signature_valid(evidence.accused, evidence.signed_bytes(), evidence.signature)
