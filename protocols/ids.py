"""Protocol ids, gossip topic names and DHT provider keys, all derived from a model id.

Everything that two peers must agree on to talk carries a version: the inference stream
protocol id, the summary topic and the provider key. A model id names the model the swarm
serves (for example a Hugging Face id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``);
it may contain ``/``, so it is validated before it becomes part of a topic or key.
"""

from __future__ import annotations

import base64
import hashlib
import re

__all__ = [
    "EVIDENCE_PROTOCOL",
    "INFER_PROTOCOL",
    "LOAD_PROTOCOL",
    "MAX_MODEL_ID_CHARS",
    "PROTOCOL_VERSION",
    "PROVIDER_NAMESPACE",
    "RING_TOPIC_PREFIX",
    "ROOTS_PROTOCOL",
    "SERVED_PROTOCOL",
    "SUMMARY_TOPIC_PREFIX",
    "gossip_topic",
    "model_id_for",
    "provider_key",
    "provider_key_multihash",
    "ring_topic",
    "ring_topic_owner",
    "split_model_id",
    "validate_model_id",
]

PROTOCOL_VERSION = "1.0.0"
INFER_PROTOCOL = f"/prefixswarm/infer/{PROTOCOL_VERSION}"
LOAD_PROTOCOL = "/prefixswarm/load/1.0.0"  # load probes (protocols/load.py), versioned apart
# Evidence of a signed wrong answer (protocols/answers.py), one frame per stream.
EVIDENCE_PROTOCOL = "/prefixswarm/evidence/1.0.0"
# Did a peer ask you for this prompt? (protocols/served.py): the check of a probation answer
SERVED_PROTOCOL = "/prefixswarm/served/1.0.0"
# Gossip mode `ring`'s lookup beyond the ring (protocols/roots.py): provider records of
# prefix roots at their home peers, and summaries on demand. Versioned apart.
ROOTS_PROTOCOL = "/prefixswarm/roots/1.0.0"
SUMMARY_TOPIC_PREFIX = "/prefixswarm/summary/1/"  # the wire version of CacheSummary is 1
# Gossip mode `ring` (version 2 of the summary protocol): one topic per publishing peer,
# `<prefix><model id>/@<peer id>`, subscribed to by that peer's ring neighbours only.
# The message is the same CacheSummary; the version says who hears it.
RING_TOPIC_PREFIX = "/prefixswarm/summary/2/"
RING_TOPIC_OWNER_MARK = "/@"  # cannot occur in a model id (segments start alphanumeric)
MAX_PEER_ID_CHARS = 128  # protocols.summary's bound on a peer id
# A model id: NAME[@DTYPE]+wFINGERPRINT (peer/engine/model.py computes the fingerprint of
# the weights and config); the dtype is left out when it is float32.
UNNAMED_DTYPE = "float32"
FINGERPRINT_MARK = "+w"
PROVIDER_NAMESPACE = "/prefixswarm/provider/1/"  # hashed with the model id into the DHT key

# Hub ids are at most 96 characters ("org/name"); 200 leaves room for a revision suffix
# while keeping topic names (sent in every gossip RPC) short.
MAX_MODEL_ID_CHARS = 200

# Path-like segments of [A-Za-z0-9._+:@=-] separated by single "/", each starting with a
# letter or digit: no empty, "." or ".." segment, no leading or trailing "/", ASCII only.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._+:@=-]*"
_MODEL_ID_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")

# Multicodec/multihash codes (https://github.com/multiformats/multicodec).
_CID_V1 = 0x01
_CODEC_RAW = 0x55
_MH_SHA2_256 = 0x12
_SHA2_256_LEN = 0x20


def validate_model_id(model_id: str) -> str:
    """Return `model_id` unchanged if it may name a model on the wire, else raise ValueError."""
    if not isinstance(model_id, str):
        raise TypeError(f"model id must be a str, got {type(model_id).__name__}")
    if not 1 <= len(model_id) <= MAX_MODEL_ID_CHARS:
        raise ValueError(
            f"model id must have 1..{MAX_MODEL_ID_CHARS} characters, got {len(model_id)}"
        )
    if _MODEL_ID_RE.fullmatch(model_id) is None:
        raise ValueError(
            f"invalid model id {model_id!r}: expected '/'-separated segments of "
            "letters, digits and ._+:@=- each starting with a letter or digit"
        )
    return model_id


def gossip_topic(model_id: str) -> str:
    """The pubsub topic on which summaries for `model_id` are published."""
    return SUMMARY_TOPIC_PREFIX + validate_model_id(model_id)


def ring_topic(model_id: str, peer_id: str) -> str:
    """The topic on which `peer_id` publishes its summaries in gossip mode `ring`."""
    if not (1 <= len(peer_id) <= MAX_PEER_ID_CHARS and peer_id.isascii() and peer_id.isalnum()):
        raise ValueError(f"invalid peer id {peer_id!r}")
    return RING_TOPIC_PREFIX + validate_model_id(model_id) + RING_TOPIC_OWNER_MARK + peer_id


def ring_topic_owner(topic: str, model_id: str) -> str | None:
    """The peer id a ring topic of `model_id` belongs to, or None if it is not one."""
    head = RING_TOPIC_PREFIX + model_id + RING_TOPIC_OWNER_MARK
    if not topic.startswith(head):
        return None
    owner = topic[len(head) :]
    if not (1 <= len(owner) <= MAX_PEER_ID_CHARS and owner.isascii() and owner.isalnum()):
        return None
    return owner


def provider_key_multihash(model_id: str) -> bytes:
    """The DHT key bytes: the sha2-256 multihash of the namespaced model id."""
    digest = hashlib.sha256((PROVIDER_NAMESPACE + validate_model_id(model_id)).encode()).digest()
    return bytes((_MH_SHA2_256, _SHA2_256_LEN)) + digest


def provider_key(model_id: str) -> str:
    """The DHT provider key for `model_id`, as a CIDv1 (raw codec, base32) string.

    py-libp2p 0.8.1 `KadDHT.provide(key: str)` and `find_providers(key: str)` take a str
    and parse it as a CID into its multihash, so this string can be passed to them as is;
    the DHT then stores `provider_key_multihash(model_id)`, the form Go/Rust peers use.
    """
    cid = bytes((_CID_V1, _CODEC_RAW)) + provider_key_multihash(model_id)
    return "b" + base64.b32encode(cid).decode("ascii").lower().rstrip("=")


def model_id_for(name: str, dtype: str, fingerprint: str) -> str:
    """The swarm-wide id: the name, the dtype unless float32, the weights' fingerprint."""
    named = name if dtype == UNNAMED_DTYPE else f"{name}@{dtype}"
    return f"{named}{FINGERPRINT_MARK}{fingerprint}"


def split_model_id(model_id: str) -> tuple[str, str, str]:
    """(name, dtype, fingerprint) of a model id: the inverse of `model_id_for`; an id
    without a fingerprint gives ''."""
    named, mark, fingerprint = model_id.rpartition(FINGERPRINT_MARK)
    if not mark:
        named, fingerprint = model_id, ""
    name, _, dtype = named.partition("@")
    return name, dtype or UNNAMED_DTYPE, fingerprint
