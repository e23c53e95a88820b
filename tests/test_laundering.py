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
    assert ledger.verify_probability("p") == pytest.approx(3 / 4)
    for _ in range(10):
        ledger.record_served("p", verified=True)
    assert ledger.verify_probability("p") == pytest.approx(3 / 14)
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


def lies_delivered(rng: random.Random, entries: int, requests: int, evidence: bool) -> int:
    """One launderer: three shadow answers matched at every entry (proxied), then a lie
    on every request the entries send it, round robin. A verified lie quarantines it at
    that entry, and everywhere at once when evidence travels."""
    ledgers = [TrustLedger(verify_fraction=DEFAULT_VERIFY_FRACTION) for _ in range(entries)]
    for ledger in ledgers:
        for _ in range(3):
            ledger.record_shadow_match("launderer")
    delivered = 0
    for i in range(requests):
        ledger = ledgers[i % entries]
        if not ledger.routable("launderer"):
            continue
        if ledger.should_verify("launderer", rng):
            for other in ledgers if evidence else [ledger]:
                other.quarantine("launderer", "wrong output", 0.0)
        else:
            delivered += 1
            ledger.record_served("launderer", verified=False)
    return delivered


def test_a_launderer_delivers_under_one_lie_on_average_with_evidence() -> None:
    rng = random.Random(3)
    trials = 2000
    with_evidence = sum(lies_delivered(rng, 3, 60, True) for _ in range(trials)) / trials
    alone = sum(lies_delivered(rng, 3, 60, False) for _ in range(trials)) / trials
    assert with_evidence <= 0.5  # 1/4 + (1/4)^2 + ... = 1/3 at the first entry
    assert alone > 2 * with_evidence  # each entry would pay its own ~1/3
