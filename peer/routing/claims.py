"""What a router believes of a remote peer's advertised speeds and batch (pure).

Claims are hypotheses, observations are facts. A summary's figures are first derived into
the cost model's units (a lone stream's decode from one stream's and the batch's speed),
and only then bounded, so no derivation can multiply a capped figure past its cap:

- observed (a forward of this entry's to that peer measured it): the claim, at most
  SPEED_SLACK x observed; the observation itself when nothing is claimed;
- else claimed: at most this peer's own figure, and unknown (<= 0) counts as ours.

An observation bounds a claim, it does not replace it: timed at the entry, it is measured
against the queue and round trip the router priced (speeds.forward_speeds), and those
are estimates, so it can read slower or faster than the peer is (taken as the speed, a
raw observation made the simulator's gpu regime at load 2 forward 7% less and wait 16%
longer). A claim can make a peer look slower than ours, never faster, until this entry
has seen it be at least half as fast as claimed; no observation makes a peer look faster
than it claims. The batch shape (`batch_slots`,
`step_tokens`) cannot be observed from outside; a claim of more than ours counts as ours.
docs/security.md ("Claims, stalls and hedges") has what remains.
"""

from __future__ import annotations

from typing import NamedTuple

from peer.config import Policy
from peer.routing.cost import BATCH_STEP_SLOPE, single_stream_decode

__all__ = [
    "LOAD_PRICED",
    "SPEED_SLACK",
    "Believed",
    "believed_batch",
    "believed_speeds",
    "claimed_decode",
    "priced_stream_decode",
]

LOAD_PRICED = frozenset({Policy.COST, Policy.LEAST_LOADED})  # rank a peer's load into its cost
SPEED_SLACK = 2.0  # a claim counts up to this many times the best observed: observations
#   on shared CPUs vary ~2x run to run (cost.SPEED_NOISE_FACTOR)


class Believed(NamedTuple):
    """The speeds a router prices a remote peer at (tokens/s, > 0)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # a lone stream's
    known: bool  # from the peer's claims or observations, not only from ours


def claimed_decode(decode_tokens_per_s: float, batch_decode_tokens_per_s: float) -> float:
    """The lone-stream decode a summary's two decode figures claim, uncapped (<= 0:
    unknown). What a forward's observed decode is held against (`TrustLedger`)."""
    if decode_tokens_per_s <= 0:
        return 0.0
    return single_stream_decode(decode_tokens_per_s, batch_decode_tokens_per_s)


def priced_stream_decode(
    lone_decode: float, running_requests: int, batch_slots: int, policy: Policy
) -> float:
    """The decode a forwarded stream should see from a peer that claims `lone_decode` for
    a lone stream while running `running_requests` (in a batch of `batch_slots`; 0:
    processor sharing, each stream 1 / (1 + running) of it; batched, each step longer by
    BATCH_STEP_SLOPE per other stream in the batch): what a forward's observed decode is
    held against. A wait for a batch slot comes before the first token, so it excuses
    nothing here. The running count is the peer's claim (and the entry's forwards in
    flight): only a policy that prices load (`LOAD_PRICED`) makes a peer that claims more
    of it dearer, so under any other the claim excuses nothing."""
    if lone_decode <= 0:
        return 0.0
    running = max(running_requests, 0) if policy in LOAD_PRICED else 0
    if batch_slots <= 0:
        return lone_decode / (1.0 + running)
    return lone_decode / (1.0 + BATCH_STEP_SLOPE * min(running, batch_slots))


def believed_speeds(
    prefill_claim: float,
    decode_claim: float,
    batch_decode_claim: float,
    observed_prefill: float,
    observed_decode: float,
    own_prefill: float,
    own_decode: float,
) -> Believed:
    """A remote peer's speeds as priced: each claim (derived first) within what was
    observed, else capped at ours. ``observed_*`` <= 0: never observed; ``own_*`` > 0
    (this peer's own lone-stream speeds, or the router's priors)."""
    if own_prefill <= 0 or own_decode <= 0:
        raise ValueError(f"own speeds must be > 0, got {own_prefill}, {own_decode}")
    decode_claimed = claimed_decode(decode_claim, batch_decode_claim)
    prefill = _believe(prefill_claim, observed_prefill, own_prefill)
    decode = _believe(decode_claimed, observed_decode, own_decode)
    known = (observed_prefill > 0 or prefill_claim > 0) and (
        observed_decode > 0 or decode_claimed > 0
    )
    return Believed(prefill, decode, known)


def _believe(claim: float, observed: float, own: float) -> float:
    if observed > 0:
        if claim <= 0:
            return observed
        ceiling = SPEED_SLACK * observed
        return claim if claim < ceiling else ceiling
    if claim > 0:
        return claim if claim < own else own
    return own


def believed_batch(
    claimed_slots: int, claimed_step_tokens: int, own_slots: int, own_step_tokens: int
) -> tuple[int, int]:
    """A peer's claimed batch shape, each part at most ours where ours is known (> 0): more
    slots or longer steps would price its queue shorter than any evidence says."""
    slots = claimed_slots if own_slots <= 0 or claimed_slots <= own_slots else own_slots
    step = claimed_step_tokens
    if own_step_tokens > 0 and (step <= 0 or step > own_step_tokens):
        step = own_step_tokens
    return slots, step
