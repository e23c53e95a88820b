"""Whether a gossiped summary is acceptable on its own, before any table state (pure).

`PeerTable.apply` asks these first: is it from the peer it names, for our model and block
size (`header_verdict`), and is its Bloom filter one a real cache could have produced
(`bloom_verdict`: not so full that it answers yes to most probes, and as full as the
cached-block count it reports). Each answers None or a (Verdict, detail) refusal.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

from protocols.summary import CacheSummary

__all__ = [
    "FILL_SIGMAS",
    "FILL_TOLERANCE",
    "MAX_PLAUSIBLE_FILL",
    "ApplyResult",
    "Verdict",
    "bloom_verdict",
    "header_verdict",
]

# A filter this full answers "yes" to most probes (at k=6, 0.9^6 = 53%): it would only
# attract requests it cannot serve from cache.
MAX_PLAUSIBLE_FILL = 0.9
# Allowed gap between the measured fill and the fill that `cached_blocks` distinct keys
# give; 0.05 is >10 standard deviations for filters of a few thousand bits or more.
FILL_TOLERANCE = 0.05
FILL_SIGMAS = 8.0  # plus this many binomial deviations, which matters for tiny filters


class Verdict(enum.StrEnum):
    """Why a summary was accepted or rejected (stable strings, for logs and metrics)."""

    NEW_PEER = "new_peer"
    UPDATED = "updated"
    IDENTITY = "identity"  # summary.peer_id is not the gossip source
    SELF = "self"  # our own summary came back
    MODEL = "model"  # another model
    BLOCK_SIZE = "block_size"  # another block size: hashes would never match
    STALE_SEQ = "stale_seq"  # seq not above the live entry's (duplicate or reordered)
    BLOOM_TOO_FULL = "bloom_too_full"
    BLOOM_INCONSISTENT = "bloom_inconsistent"  # fill disagrees with cached_blocks
    TABLE_FULL = "table_full"
    UNPROVEN_FULL = "unproven_full"  # never reached, and unproven peers hold their share
    LEFT = "left"  # the peer said it stops: dropped now


class ApplyResult(NamedTuple):
    """The outcome of `PeerTable.apply`."""

    accepted: bool
    reason: Verdict
    detail: str = ""


def header_verdict(
    summary: CacheSummary, source_peer_id: str, self_id: str, model_id: str, block_size: int
) -> tuple[Verdict, str] | None:
    """A refusal if `summary` (gossiped by `source_peer_id`) is not another peer's own,
    for our `model_id` and `block_size`; None if it is."""
    peer_id = summary.peer_id
    if peer_id != source_peer_id:
        return Verdict.IDENTITY, f"from {source_peer_id}, claims to be {peer_id}"
    if peer_id == self_id:
        return Verdict.SELF, "our own summary"
    if summary.model_id != model_id:
        return Verdict.MODEL, f"model {summary.model_id!r}, we serve {model_id!r}"
    if summary.block_size != block_size:
        return Verdict.BLOCK_SIZE, f"block size {summary.block_size}, ours is {block_size}"
    return None


def bloom_verdict(summary: CacheSummary) -> tuple[Verdict, str] | None:
    """A refusal if the summary's filter is implausible (too full, or its fill disagrees
    with `cached_blocks`); None if it is plausible."""
    # BloomFilter.fill_ratio and expected_fill, on the summary's bytes (one popcount
    # instead of decoding the filter, which routing never needs: it reads the bank)
    bits = summary.bloom_bits
    fill = int.from_bytes(summary.bloom, "little").bit_count() / bits
    if fill > MAX_PLAUSIBLE_FILL:
        return Verdict.BLOOM_TOO_FULL, f"fill {fill:.3f} > {MAX_PLAUSIBLE_FILL}"
    expected = 1.0 - math.exp(-summary.cached_blocks * summary.bloom_hashes / bits)
    sigma = math.sqrt(expected * (1.0 - expected) / bits)
    if abs(fill - expected) > FILL_TOLERANCE + FILL_SIGMAS * sigma:
        count = summary.bloom_filter().estimated_count()
        return (Verdict.BLOOM_INCONSISTENT,
                f"fill {fill:.3f}, but {summary.cached_blocks} cached blocks give "
                f"{expected:.3f} (~{count:.0f} keys in the filter)")
    return None
