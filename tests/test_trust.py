"""The trust ledger (pure): probation, verification draws, claims, speeds, quarantine."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.routing.reliability import DEBT_HALF_LIFE_S, Lapse
from peer.routing.trust import (
    DEFAULT_VERIFY_FRACTION,
    ClaimsState,
    Promote,
    Quarantine,
    QuarantineRecord,
    TrustLedger,
    TrustState,
    dump_quarantine,
    parse_quarantine,
)


def test_new_peer_is_on_probation_until_k_verified_responses():
    ledger = TrustLedger(probation_requests=3)
    assert ledger.view("p").state is TrustState.PROBATION
    rng = random.Random(0)
    assert all(ledger.should_verify("p", rng) for _ in range(100))  # fraction 1.0 on probation
    assert ledger.record_served("p", verified=False) is None  # unverified: does not count
    assert ledger.record_served("p", verified=True) is None
    assert ledger.record_served("p", verified=True) is None
    assert ledger.record_served("p", verified=True) == Promote("p", 3)
    assert ledger.view("p").state is TrustState.TRUSTED
    assert not ledger.on_probation("p")


def test_without_a_verifier_only_matching_shadow_answers_end_probation():
    ledger = TrustLedger(probation_requests=2, can_verify=False)
    assert not ledger.should_verify("p", random.Random(0))
    for _ in range(5):
        assert ledger.record_served("p", verified=False) is None  # unchecked: never counts
    assert ledger.on_probation("p")
    assert ledger.record_shadow_match("p") is None
    assert ledger.record_shadow_match("p") == Promote("p", 2)
    assert ledger.view("p").state is TrustState.TRUSTED
    assert ledger.view("p").served == 5  # shadows reached no client


def test_a_shadow_match_of_a_quarantined_peer_changes_nothing():
    ledger = TrustLedger(probation_requests=1)
    ledger.quarantine("p", "lied", 1.0)
    assert ledger.record_shadow_match("p") is None
    assert ledger.view("p").state is TrustState.QUARANTINED


def test_quarantine_is_final_and_persisted_with_its_reason():
    ledger = TrustLedger()
    action = ledger.quarantine("p", "wrong token at 3", now=5.0)
    assert action == Quarantine("p", "wrong token at 3", 5.0)
    assert ledger.quarantine("p", "again", now=6.0) is None
    assert not ledger.routable("p")
    assert ledger.view("p").state is TrustState.QUARANTINED
    assert ledger.view("p").discount == 0.0
    assert ledger.record_served("p", verified=True) is None
    text = dump_quarantine(ledger.quarantine_records())
    reloaded = TrustLedger(quarantined=parse_quarantine(text))
    assert not reloaded.routable("p")
    assert reloaded.view("p").reason == "wrong token at 3"


@pytest.mark.parametrize(
    "text",
    ["", "[]", '{"version": 2}', '{"version": 1, "quarantined": [1]}',
     '{"version": 1, "quarantined": [{"peer_id": "", "reason": "x", "at": 0}]}',
     '{"version": 1, "quarantined": [{"peer_id": "p", "reason": "x", "at": true}]}',
     "[" * 100_000],
)
def test_a_bad_quarantine_file_is_a_clear_error(text):
    with pytest.raises(ValueError):
        parse_quarantine(text)


def test_claims_that_keep_overshooting_are_discounted_then_ignored():
    ledger = TrustLedger()
    states = [ledger.record_claim("liar", 160, 0) for _ in range(8)]
    assert states[0] is ClaimsState.BELIEVED  # a false positive or two is explained
    assert ClaimsState.DISCOUNTED in states
    assert states[-1] is ClaimsState.IGNORED
    assert ledger.claim_factor("liar") == 0.0


def test_claims_at_the_honest_overshoot_rate_keep_full_weight():
    ledger = TrustLedger()
    rng = random.Random(1)
    for _ in range(1000):  # a stale summary or a false positive one claim in 20
        ledger.record_claim("honest", 64, 48 if rng.random() < 0.05 else 64)
    assert ledger.claim_factor("honest") == 1.0
    assert ledger.view("honest").claims is ClaimsState.BELIEVED


@given(st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 4096)), max_size=200))
@settings(max_examples=200, deadline=None)
def test_claim_factor_is_in_unit_range_and_never_rises_on_an_overshoot(claims):
    ledger = TrustLedger()
    for claimed, cached in claims:
        before = ledger.claim_factor("p")
        ledger.record_claim("p", claimed, cached)
        after = ledger.claim_factor("p")
        assert 0.0 <= after <= 1.0
        if claimed > cached:
            assert after <= before


def test_the_best_observed_speeds_are_what_the_router_reads():
    ledger = TrustLedger()
    assert ledger.routing("p").observed_prefill == 0.0  # never observed
    ledger.record_speeds("p", 800.0, 20.0)
    ledger.record_speeds("p", 1000.0, None)
    ledger.record_speeds("p", 600.0, 15.0)
    standing = ledger.routing("p")
    assert (standing.observed_prefill, standing.observed_decode) == (1000.0, 20.0)
    assert ledger.view("p").observed_prefill_tokens_per_s == 1000.0


def test_default_fraction_quarantines_an_always_lying_peer_within_50_forwards():
    """Simulated: 1000 trials of a trusted peer that lies on every response."""
    rng = random.Random(7)
    caught_within_50 = 0
    for _ in range(1000):
        ledger = TrustLedger(probation_requests=0)
        for _ in range(50):
            if ledger.should_verify("liar", rng):
                ledger.quarantine("liar", "wrong tokens", 0.0)
                break
        caught_within_50 += not ledger.routable("liar")
    assert DEFAULT_VERIFY_FRACTION >= 0.06
    assert caught_within_50 / 1000 >= 0.95


def test_records_are_bounded():
    ledger = TrustLedger(quarantined=[QuarantineRecord(f"p{i}", "x", 0.0) for i in range(10)])
    assert ledger.statistics()["peers_quarantined"] == 10
    for i in range(5000):
        ledger.record_claim(f"q{i}", 0, 0)
    assert ledger.statistics()["peers_tracked"] == 4096


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_bad_fraction_is_rejected(bad):
    with pytest.raises(ValueError):
        TrustLedger(verify_fraction=bad)


def test_routing_view_follows_every_change_and_hides_the_quarantined():
    ledger = TrustLedger(probation_requests=1)
    assert ledger.routing("p")[:4] == (True, 1.0, 0.0, 0.0)
    ledger.record_served("p", verified=True)
    ledger.record_speeds("p", 100.0, 10.0)
    assert ledger.routing("p")[:4] == (False, 1.0, 100.0, 10.0)
    assert ledger.routing("p").demoted_until == -math.inf
    ledger.record_lapse("p", Lapse.STALLED, 5.0)
    assert ledger.routing("p").demoted_until > 5.0 + DEBT_HALF_LIFE_S
    for _ in range(5):
        ledger.record_claim("p", 64, 0)
    assert ledger.routing("p").factor == ledger.claim_factor("p") < 1.0
    ledger.quarantine("p", "x", 0.0)
    ledger.record_claim("p", 64, 0)  # a late report about it changes nothing
    assert ledger.routing("p") is None
