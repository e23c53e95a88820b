"""Probation laundering: a peer that passed probation on answers it obtained elsewhere
(proxied to an honest peer) and then lies has its first answers to clients audited
(re-scored after delivery), so it delivers at most one lie per entry before it is caught,
and evidence spreads the catch."""

from __future__ import annotations

import random

from peer.routing.trust import DEFAULT_VERIFY_FRACTION, TrustLedger


def test_the_first_answers_after_promotion_are_audited_and_gated_at_the_fraction() -> None:
    ledger = TrustLedger(probation_requests=3, verify_fraction=0.1)
    assert not ledger.should_audit("p")  # on probation: every answer is a compared shadow
    for _ in range(3):
        ledger.record_shadow_match("p")
    assert not ledger.on_probation("p")
    assert ledger.verify_probability("p") == 0.1  # no answer held back beyond the fraction
    for _ in range(3):  # its first three answers to clients: audited
        assert ledger.should_audit("p")
        ledger.record_audit("p")
        ledger.record_served("p", verified=False)
    assert not ledger.should_audit("p")
    assert ledger.statistics()["audited"] == 3
    ledger.quarantine("q", "lied", 0.0)
    assert not ledger.should_audit("q")


def test_a_fraction_of_zero_verifies_and_audits_no_trusted_peer() -> None:
    ledger = TrustLedger(probation_requests=3, verify_fraction=0.0)
    for _ in range(3):
        ledger.record_shadow_match("p")
    assert ledger.verify_probability("p") == 0.0
    assert not ledger.should_audit("p")


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
        audited = not verified and ledger.should_audit("launderer")
        if audited:
            ledger.record_audit("launderer")
        if served[e] < honest_first:
            served[e] += 1
            ledger.record_served("launderer", verified=verified)
            continue
        if not verified:  # delivered: a lie reached the client
            delivered += 1
            ledger.record_served("launderer", verified=False)
        if verified or audited:
            for other in ledgers if evidence else [ledger]:
                other.quarantine("launderer", "wrong output", 0.0)
    return delivered


def test_a_launderer_that_lies_once_trusted_delivers_one_lie_with_evidence() -> None:
    rng = random.Random(3)
    alone = [lies_delivered(rng, 3, 60, False, 0) for _ in range(200)]
    spread = [lies_delivered(rng, 3, 60, True, 0) for _ in range(200)]
    assert max(alone) <= 3  # one per entry at most: each entry audits its first answers
    assert max(spread) <= 1  # the first audit's evidence quarantines it everywhere


def test_evidence_makes_a_patient_launderer_pay_once_for_the_swarm() -> None:
    """Honest for 40 answers per entry (the ramp is down to the fraction), then lying:
    each entry alone would deliver ~9 lies; with evidence the first catch ends it."""
    rng = random.Random(4)
    trials = 300
    spread = sum(lies_delivered(rng, 3, 600, True, 40) for _ in range(trials)) / trials
    alone = sum(lies_delivered(rng, 3, 600, False, 40) for _ in range(trials)) / trials
    assert spread < 12 and alone > 2 * spread
