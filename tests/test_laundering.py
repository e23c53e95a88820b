"""Probation laundering: a peer that passed probation on answers it obtained elsewhere
(proxied to an honest peer) and then lies is checked almost surely on its first answers
to clients (the trust ledger's ramp), so few lies get through before it is caught."""

from __future__ import annotations

import random

import pytest

from peer.routing.trust import DEFAULT_VERIFY_FRACTION, TrustLedger


def test_verification_ramps_down_from_promotion_to_the_fraction() -> None:
    ledger = TrustLedger(probation_requests=3, verify_fraction=0.1)
    for _ in range(3):
        ledger.record_shadow_match("p")
    assert not ledger.on_probation("p")
    for _ in range(3):  # its first three answers to clients: all verified
        assert ledger.verify_probability("p") == 1.0
        ledger.record_served("p", verified=True)
    assert ledger.verify_probability("p") == 1.0  # 3 / 1
    ledger.record_served("p", verified=True)
    assert ledger.verify_probability("p") == 1.0  # 3 / 2, capped
    for _ in range(9):
        ledger.record_served("p", verified=True)
    assert ledger.verify_probability("p") == pytest.approx(3 / 11)
    for _ in range(100):
        ledger.record_served("p", verified=True)
    assert ledger.verify_probability("p") == 0.1
    for _ in range(100):  # unverified answers earn nothing
        ledger.record_served("q", verified=False)
    assert ledger.verify_probability("q") == 1.0


def test_a_fraction_of_zero_verifies_no_trusted_peer() -> None:
    ledger = TrustLedger(probation_requests=3, verify_fraction=0.0)
    for _ in range(3):
        ledger.record_shadow_match("p")
    assert ledger.verify_probability("p") == 0.0


def lies_delivered(
    rng: random.Random, entries: int, requests: int, evidence: bool, honest_first: int
) -> int:
    """One launderer: three shadow answers matched at every entry (proxied), then
    `honest_first` good answers per entry (proxied too), then a lie on every request the
    entries send it, round robin. A verified lie quarantines it at that entry, and
    everywhere at once when evidence travels."""
    ledgers = [TrustLedger(verify_fraction=DEFAULT_VERIFY_FRACTION) for _ in range(entries)]
    for ledger in ledgers:
        for _ in range(3):
            ledger.record_shadow_match("launderer")
    served = [0] * entries
    delivered = 0
    for i in range(requests):
        e = i % entries
        ledger = ledgers[e]
        if not ledger.routable("launderer"):
            continue
        verified = ledger.should_verify("launderer", rng)
        if served[e] < honest_first:
            served[e] += 1
            ledger.record_served("launderer", verified=verified)
        elif verified:
            for other in ledgers if evidence else [ledger]:
                other.quarantine("launderer", "wrong output", 0.0)
        else:
            delivered += 1
            ledger.record_served("launderer", verified=False)
    return delivered


def test_a_launderer_that_lies_once_trusted_delivers_no_lie() -> None:
    rng = random.Random(3)
    assert all(lies_delivered(rng, 3, 60, False, 0) == 0 for _ in range(200))


def test_evidence_makes_a_patient_launderer_pay_once_for_the_swarm() -> None:
    """Honest for 40 answers per entry (the ramp is down to the fraction), then lying:
    each entry alone would deliver ~9 lies; with evidence the first catch ends it."""
    rng = random.Random(4)
    trials = 300
    spread = sum(lies_delivered(rng, 3, 600, True, 40) for _ in range(trials)) / trials
    alone = sum(lies_delivered(rng, 3, 600, False, 40) for _ in range(trials)) / trials
    assert spread < 12 and alone > 2 * spread
