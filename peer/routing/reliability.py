"""A peer's reliability debt: what its lapses cost clients, charged and repaid (pure).

Every lapse that cost a client time is charged in units of one failure: a failure or a
stall (no first token by its deadline, or silence between tokens) 1; a hedge race lost
(a later candidate answered first) HEDGE_LOST_CHARGE; a forward that decoded far slower
than the peer claimed, graded by how far. Each response served repays
SERVED_CREDIT, and the debt halves every DEBT_HALF_LIFE_S. While the debt is above
RELEASE_DEBT after reaching DEMOTE_DEBT the router ranks the peer after the entry peer
itself, as it does a peer that just failed.

Why graded and bounded: estimates on shared CPUs are off by 2x, so an honest peer loses
an occasional hedge; at half a failure per hedge lost and a quarter repaid per success
it would have to lose about one race in three, consistently, to be demoted, and then
only for a half-life or so (and since observed speeds bound its claims, its estimates,
and so its hedge delays, soon fit it). A peer that stalls every stream it is given pays
a hedge lost or a failure each try and is demoted after two at most; the debt is capped
(MAX_DEBT) so that even a long bad spell is forgiven within a few half-lives: a demotion
is never a quarantine, which only a verified lie earns.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

__all__ = [
    "DEBT_HALF_LIFE_S",
    "DEMOTE_DEBT",
    "HEDGE_LOST_CHARGE",
    "MAX_DEBT",
    "RELEASE_DEBT",
    "SERVED_CREDIT",
    "UNDERDELIVERY_SLACK",
    "Debt",
    "Lapse",
    "charge",
    "credit",
    "underdelivery_charge",
]

FAILURE_CHARGE = 1.0  # the unit: an attempt that failed or stalled
HEDGE_LOST_CHARGE = 0.5  # no first token by its hedge delay (>= 2x its estimate), beaten
#   by a later start: half a failure, so two in a row without a success demote
SERVED_CREDIT = 0.25  # a response delivered repays a quarter of a failure
DEMOTE_DEBT = 0.9  # a failure, or two hedges lost within ~10 s: ranked after self, as a
#   failed peer is (under 1.0 so that the decay between two lapses cannot keep them under)
RELEASE_DEBT = DEMOTE_DEBT / 2  # ... until the debt has halved (one half-life at least)
DEBT_HALF_LIFE_S = 30.0  # a demoted honest peer gets traffic back within about a minute
MAX_DEBT = 8.0  # at most ~4 half-lives (2 minutes) of demotion, however long the bad spell
# Observed decode this many times slower than claimed before any charge: observations at
# a busy batch run up to ~1.9x below a lone stream's speed (cost.BATCH_STEP_SLOPE at 8
# streams), times the ~2x noise of shared CPUs.
UNDERDELIVERY_SLACK = 4.0
UNDERDELIVERY_FULL_RATIO = 8.0  # ... and a full failure's charge at 8x past the slack


class Lapse(enum.StrEnum):
    """What a peer did that cost a client time (the ledger's charge kinds)."""

    FAILED = "failed"  # broke, refused a valid request, or stalled past a deadline
    STALLED = "stalled"  # no first token by its deadline, or silent between tokens
    HEDGE_LOST = "hedge_lost"
    UNDERDELIVERED = "underdelivered"  # decoded far slower than it claimed


CHARGES = {
    Lapse.FAILED: FAILURE_CHARGE,
    Lapse.STALLED: FAILURE_CHARGE,
    Lapse.HEDGE_LOST: HEDGE_LOST_CHARGE,
}


class Debt(NamedTuple):
    """A peer's debt at ``at`` (the shell's clock), and until when it ranks after self."""

    amount: float = 0.0
    at: float = 0.0
    demoted_until: float = -math.inf


def decayed(debt: Debt, now: float) -> float:
    """The debt's amount at ``now`` (halved every DEBT_HALF_LIFE_S since ``debt.at``)."""
    elapsed = now - debt.at
    if elapsed <= 0 or debt.amount == 0.0:
        return debt.amount
    factor: float = 0.5 ** (elapsed / DEBT_HALF_LIFE_S)
    return debt.amount * factor


def charge(debt: Debt, amount: float, now: float) -> Debt:
    """``debt`` after a lapse charged ``amount`` (>= 0) at ``now``."""
    if not (math.isfinite(amount) and amount >= 0):
        raise ValueError(f"a charge must be finite and >= 0, got {amount}")
    total = min(MAX_DEBT, decayed(debt, now) + amount)
    until = debt.demoted_until
    if total >= DEMOTE_DEBT:
        until = max(until, now + DEBT_HALF_LIFE_S * math.log2(total / RELEASE_DEBT))
    return Debt(total, now, until)


def credit(debt: Debt, now: float) -> Debt:
    """``debt`` after a response served at ``now``: SERVED_CREDIT repaid. A demotion ends
    early once the debt is under RELEASE_DEBT."""
    total = max(0.0, decayed(debt, now) - SERVED_CREDIT)
    until = debt.demoted_until
    if until > now:
        until = now + DEBT_HALF_LIFE_S * math.log2(total / RELEASE_DEBT) if (
            total > RELEASE_DEBT) else -math.inf
    return Debt(total, now, until)


def underdelivery_charge(claimed_decode: float, observed_decode: float) -> float:
    """The charge for decoding at ``observed_decode`` after claiming ``claimed_decode``
    (a lone stream's, tokens/s): 0 within UNDERDELIVERY_SLACK, then growing with the
    log of the shortfall to a full failure's at UNDERDELIVERY_FULL_RATIO past it."""
    if claimed_decode <= 0 or observed_decode <= 0:
        return 0.0
    ratio = claimed_decode / (observed_decode * UNDERDELIVERY_SLACK)
    if ratio <= 1.0:
        return 0.0
    return min(FAILURE_CHARGE, math.log(ratio) / math.log(UNDERDELIVERY_FULL_RATIO))
