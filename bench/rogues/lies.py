"""The lies of bench/rogue.py, pure: poisoned summaries, wrong tokens, forged messages.

Each stays within what an honest peer's validation accepts on its own (a summary's
format and bounds, a message's signature), so what catches it is the defence measured,
not a parser. Tests call these directly.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import PUBSUB_SIGNING_PREFIX

from protocols.bloom import BloomFilter
from protocols.infer import InferRequest
from protocols.summary import CacheSummary

__all__ = [
    "EXTRA_TOKENS",
    "NUCLEUS_MARGIN",
    "POISON_BLOOM_BITS",
    "POISON_FILL",
    "POISON_SPEED",
    "forged_message",
    "out_of_nucleus",
    "poisoned_bloom",
    "poisoned_summary",
    "wrong_tokens",
]

POISON_BLOOM_BITS = 1 << 16  # 8 KiB: an ordinary summary size
POISON_FILL = 0.88  # under the table's 0.9 "too full" bound
POISON_SPEED = 1e9  # protocols.summary.MAX_TOKENS_PER_S: the largest accepted claim
# wrong_tokens_sampled: tokens outside the nucleus widened by this much probability mass,
# beyond any verifier's tolerance for rounding near the cut (peer/engine/verify.py: 0.01).
NUCLEUS_MARGIN = 0.05
EXTRA_TOKENS = 8  # wrong_tokens_*: this many tokens beyond max_new_tokens


@functools.lru_cache(maxsize=4)
def poisoned_bloom(seed: int) -> BloomFilter:
    """A k=1 filter with POISON_FILL of its bits set at random (built once per seed:
    ~0.1 s of Python, too slow to redo for every summary of 10 identities)."""
    rng = random.Random(seed)
    bits = [rng.random() < POISON_FILL for _ in range(POISON_BLOOM_BITS)]
    data = bytes(
        sum(1 << j for j in range(8) if bits[8 * i + j]) for i in range(POISON_BLOOM_BITS // 8)
    )
    return BloomFilter.from_bytes(POISON_BLOOM_BITS, 1, data)


def poisoned_summary(
    peer_id: str, model_id: str, block_size: int, seq: int, rng: random.Random
) -> CacheSummary:
    """A summary every honest table accepts that claims nearly every prefix, no load and
    the fastest speed the format allows."""
    bloom = poisoned_bloom(rng.randrange(4))
    cached = round(bloom.estimated_count())  # the count that explains this fill exactly
    return CacheSummary(
        peer_id=peer_id,
        model_id=model_id,
        block_size=block_size,
        seq=seq,
        bloom_bits=POISON_BLOOM_BITS,
        bloom_hashes=1,
        bloom=bloom.to_bytes(),
        cached_blocks=cached,
        capacity_blocks=cached,
        queued_prompt_tokens=0,
        running_requests=0,
        prefill_tokens_per_s=POISON_SPEED,
        decode_tokens_per_s=POISON_SPEED,
    )


def wrong_tokens(request: InferRequest, vocab_size: int, rng: random.Random) -> list[int]:
    """More tokens than asked for, none of them the model's choice (random ids)."""
    return [rng.randrange(vocab_size) for _ in range(request.max_new_tokens + EXTRA_TOKENS)]


def out_of_nucleus(logits: Any, temperature: float, top_p: float) -> int:
    """The most likely token that sampling at (temperature, top_p + NUCLEUS_MARGIN) can
    never draw; the least likely token when that nucleus holds the whole vocabulary."""
    import torch

    probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = (torch.cumsum(sorted_p, dim=0) - sorted_p) < top_p + NUCLEUS_MARGIN
    outside = int(keep.sum())
    return int(order[min(outside, len(order) - 1)])


def forged_message(keys: Any, topic: str, data: bytes, rng: random.Random) -> rpc_pb2.Message:
    """A pubsub message from the identity of `keys` (a libp2p KeyPair), validly signed."""
    msg = rpc_pb2.Message(
        data=data,
        topicIDs=[topic],
        from_id=ID.from_pubkey(keys.public_key).to_bytes(),
        seqno=rng.randbytes(8),
    )
    msg.signature = keys.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = keys.public_key.serialize()
    return msg
