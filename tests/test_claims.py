"""Claims are hypotheses, observations are facts: advertised speeds capped after every
derivation (peer/routing/claims.py), and the reliability debt that lapses charge
(peer/routing/reliability.py), alone and through the router."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.claims import (
    LOAD_PRICED,
    SPEED_SLACK,
    believed_batch,
    believed_speeds,
    claimed_decode,
    priced_stream_decode,
)
from peer.routing.cost import BATCH_STEP_SLOPE
from peer.routing.reliability import (
    DEBT_HALF_LIFE_S,
    HEDGE_LOST_CHARGE,
    MAX_DEBT,
    RELEASE_DEBT,
    Debt,
    Lapse,
    charge,
    credit,
    decayed,
    underdelivery_charge,
)
from peer.routing.router import Router
from peer.routing.trust import TrustLedger
from tests.test_router import BS, SELF, chain_of, me, summary, table_with

OWN_PREFILL, OWN_DECODE = 1000.0, 20.0  # me()'s speeds
NEW = 16

speeds = st.one_of(
    st.just(0.0), st.just(1e-9), st.just(1e9),
    st.floats(min_value=0.0, max_value=1e9, allow_nan=False),
)


# -- the pure cap ---------------------------------------------------------------------------


@given(speeds, speeds, speeds)
def test_no_claim_is_priced_faster_than_ours_before_an_observation(prefill, decode, batch):
    believed = believed_speeds(prefill, decode, batch, 0.0, 0.0, OWN_PREFILL, OWN_DECODE)
    assert 0 < believed.prefill_tokens_per_s <= OWN_PREFILL
    assert 0 < believed.decode_tokens_per_s <= OWN_DECODE


@given(speeds, speeds, speeds, st.floats(1.0, 1e6), st.floats(1.0, 1e6))
def test_an_observation_bounds_any_claim(prefill, decode, batch, seen_prefill, seen_decode):
    believed = believed_speeds(prefill, decode, batch, seen_prefill, seen_decode,
                               OWN_PREFILL, OWN_DECODE)
    assert 0 < believed.prefill_tokens_per_s <= SPEED_SLACK * seen_prefill
    assert 0 < believed.decode_tokens_per_s <= SPEED_SLACK * seen_decode
    # never faster than claimed; with nothing claimed, what was seen
    assert believed.prefill_tokens_per_s <= (prefill if prefill > 0 else seen_prefill)
    lone = claimed_decode(decode, batch)
    assert believed.decode_tokens_per_s <= (lone if lone > 0 else seen_decode)
    assert believed.known


def test_an_observation_is_a_ceiling_at_twice_it_and_never_lifts_a_claim():
    assert believed_speeds(0.0, 0.0, 0.0, 300.0, 9.0, OWN_PREFILL, OWN_DECODE)[:2] == (300.0, 9.0)
    assert believed_speeds(100.0, 5.0, 0.0, 300.0, 9.0, OWN_PREFILL, OWN_DECODE)[:2] == (
        100.0, 5.0)  # seen faster than it says: what it says
    assert believed_speeds(500.0, 15.0, 0.0, 300.0, 9.0, OWN_PREFILL, OWN_DECODE)[:2] == (
        500.0, 15.0)  # within twice what was seen
    assert believed_speeds(1e9, 1e-3, 1e9, 300.0, 9.0, OWN_PREFILL, OWN_DECODE)[:2] == (
        600.0, 18.0)


def test_the_batch_ratio_cannot_lift_a_tiny_decode_past_the_cap():
    # decode ~0 with a batch of 1e9: the ratio would make a lone stream 1.2e8 tokens/s.
    assert claimed_decode(1e-3, 1e9) > 1e8
    believed = believed_speeds(0.0, 1e-3, 1e9, 0.0, 0.0, OWN_PREFILL, OWN_DECODE)
    assert believed.decode_tokens_per_s == OWN_DECODE
    # prefill 1e9 with decode 0 (unknown): prefill capped all the same, decode ours.
    believed = believed_speeds(1e9, 0.0, 0.0, 0.0, 0.0, OWN_PREFILL, OWN_DECODE)
    assert believed[:2] == (OWN_PREFILL, OWN_DECODE)
    assert not believed.known  # decode came from ours


def test_a_slower_claim_is_believed():
    believed = believed_speeds(100.0, 5.0, 0.0, 0.0, 0.0, OWN_PREFILL, OWN_DECODE)
    assert believed[:2] == (100.0, 5.0) and believed.known


def test_a_batch_shape_counts_up_to_ours():
    assert believed_batch(65_536, 1 << 30, 8, 256) == (8, 256)
    assert believed_batch(4, 128, 8, 256) == (4, 128)
    assert believed_batch(4, 0, 8, 256) == (4, 256)  # unknown step: ours, not free
    assert believed_batch(1, 0, 0, 0) == (1, 0)  # ours unknown: the claim


# -- through the router ---------------------------------------------------------------------


def _trusted(*peer_ids: str) -> TrustLedger:
    ledger = TrustLedger()
    for peer_id in peer_ids:
        for _ in range(ledger.probation_requests):
            ledger.record_served(peer_id, verified=True)
    return ledger


@pytest.mark.parametrize(
    "claims",
    [
        {"decode_tokens_per_s": 1e-3, "batch_decode_tokens_per_s": 1e9, "batch_slots": 1},
        {"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 0.0},
        {"decode_tokens_per_s": 0.0, "batch_decode_tokens_per_s": 1e9, "batch_slots": 1},
    ],
)
def test_a_magnet_summary_is_priced_no_faster_than_this_peer(claims):
    chain = chain_of(40)
    magnet = dataclasses.replace(summary("magnet", []), **claims)
    table = table_with(magnet, summary("honest", []))
    for peer_id in ("magnet", "honest"):
        table.record_rtt(peer_id, 0.002, 0.0)
    r = Router(Policy.COST, random.Random(0), block_size=BS, trust=_trusted("magnet", "honest"),
               require_rtt=True)
    ranked = {c.peer_id: c for c in r.rank(chain, 40 * BS, NEW, me(), table, 0.0)}
    assert ranked["magnet"].estimate.prefill_tokens_per_s <= OWN_PREFILL
    assert ranked["magnet"].estimate.decode_tokens_per_s <= OWN_DECODE
    # It costs no less than the honest peer that claims exactly our speeds.
    assert ranked["magnet"].cost_s >= ranked["honest"].cost_s


def test_a_demoted_peer_ranks_after_self_until_its_debt_has_halved():
    chain = chain_of(40)
    ledger = _trusted("p")
    r = Router(Policy.COST, random.Random(0), block_size=BS, trust=ledger, require_rtt=True)

    def fresh_table(now):
        table = table_with(summary("p", chain), now=now)  # holds the whole prompt
        table.record_rtt("p", 0.002, now)
        return table

    table = fresh_table(0.0)

    def order(now):
        return [c.peer_id for c in r.rank(chain, 40 * BS, NEW, me(), fresh_table(now), now)]

    assert order(0.0) == ["p", SELF]
    ledger.record_lapse("p", Lapse.HEDGE_LOST, 0.0)
    assert order(0.0) == ["p", SELF]  # one hedge lost: not yet
    ledger.record_served("p", verified=False, now=0.5)  # repays half of it
    ledger.record_lapse("p", Lapse.HEDGE_LOST, 1.0)  # ~0.75 in all: not yet
    assert order(1.0) == ["p", SELF]
    ledger.record_lapse("p", Lapse.STALLED, 2.0)
    ranked = r.rank(chain, 40 * BS, NEW, me(), table, 3.0)
    assert [c.peer_id for c in ranked] == [SELF, "p"]
    assert ranked[1].estimate.failed_s_ago == pytest.approx(1.0)
    until = ledger.routing("p").demoted_until
    assert order(until - 0.01) == [SELF, "p"]
    assert order(until) == ["p", SELF]


# -- the debt ----------------------------------------------------------------------------


def test_a_failure_demotes_until_its_debt_has_decayed_under_release():
    debt = charge(Debt(), 1.0, 10.0)
    lasts = DEBT_HALF_LIFE_S * math.log2(1 / RELEASE_DEBT)
    assert debt.demoted_until == pytest.approx(10.0 + lasts)
    assert DEBT_HALF_LIFE_S < debt.demoted_until - 10.0 < 1.2 * DEBT_HALF_LIFE_S
    assert decayed(debt, 10.0 + DEBT_HALF_LIFE_S) == pytest.approx(0.5)


def test_one_hedge_lost_never_demotes_and_successes_repay():
    debt = charge(Debt(), HEDGE_LOST_CHARGE, 0.0)
    assert debt.demoted_until == -math.inf
    debt = credit(credit(debt, 0.0), 0.0)
    assert debt.amount == 0.0
    assert charge(debt, HEDGE_LOST_CHARGE, 0.0).demoted_until == -math.inf


def test_an_honest_peer_that_loses_one_race_in_four_is_never_demoted():
    debt = Debt()
    for i in range(400):  # one request a second
        now = float(i)
        debt = charge(debt, HEDGE_LOST_CHARGE, now) if i % 4 == 0 else credit(debt, now)
        assert debt.demoted_until < now


def test_a_staller_is_demoted_at_its_second_hedge_lost_and_stays_bounded():
    debt = charge(Debt(), HEDGE_LOST_CHARGE, 0.0)
    debt = charge(debt, HEDGE_LOST_CHARGE, 5.0)  # 5 s apart: decay cannot hide the pair
    assert debt.demoted_until > 5.0 + DEBT_HALF_LIFE_S
    for _ in range(100):
        debt = charge(debt, 1.0, 5.0)
    assert debt.amount == MAX_DEBT
    longest = DEBT_HALF_LIFE_S * math.log2(MAX_DEBT / RELEASE_DEBT)
    assert debt.demoted_until == pytest.approx(5.0 + longest)
    assert longest <= 130.0


def test_a_success_ends_a_demotion_once_the_debt_is_under_release():
    debt = charge(Debt(), 1.0, 0.0)
    longest = debt.demoted_until
    debt = credit(debt, 0.0)  # 0.75: still demoted, for less long
    assert 0.0 < debt.demoted_until < longest
    debt = credit(credit(debt, 0.0), 0.0)  # 0.25: released
    assert debt.demoted_until == -math.inf


@given(st.lists(st.tuples(st.sampled_from(["charge", "credit"]), st.floats(0.0, 2.0),
                          st.floats(0.0, 100.0)), max_size=40))
def test_the_debt_stays_within_bounds(steps):
    debt, now = Debt(), 0.0
    for kind, amount, dt in steps:
        now += dt
        debt = charge(debt, amount, now) if kind == "charge" else credit(debt, now)
        assert 0.0 <= debt.amount <= MAX_DEBT
        longest = DEBT_HALF_LIFE_S * math.log2(MAX_DEBT / RELEASE_DEBT)
        assert debt.demoted_until <= now + longest + 1e-9


def test_underdelivery_is_graded_from_the_slack_to_a_full_failure():
    assert underdelivery_charge(20.0, 10.0) == 0.0  # 2x: noise
    assert underdelivery_charge(20.0, 5.0) == 0.0  # 4x: a busy batch on a shared CPU
    assert 0.0 < underdelivery_charge(20.0, 2.5) < 1.0  # 8x
    assert underdelivery_charge(20.0, 0.5) == 1.0
    assert underdelivery_charge(1.2e8, 100.0) == 1.0  # a magnet's claim
    assert underdelivery_charge(0.0, 1.0) == 0.0  # nothing claimed


def test_a_decode_is_judged_against_the_load_the_router_priced():
    """A peer claiming 20 tokens/s alone and running 7 streams (processor sharing) was
    priced at 20 / 8 for one more: 2.5 tokens/s observed is what was priced, no charge;
    the same observation from a peer that claimed to be idle is 8x short, charged."""
    busy = priced_stream_decode(20.0, 7, 0, Policy.COST)
    assert busy == pytest.approx(2.5)
    assert underdelivery_charge(busy, 2.5) == 0.0
    assert underdelivery_charge(priced_stream_decode(20.0, 0, 0, Policy.COST), 2.5) > 0.0
    batched = priced_stream_decode(20.0, 3, 8, Policy.COST)  # each step 1 + 3 x slope
    assert batched == pytest.approx(20.0 / (1 + 3 * BATCH_STEP_SLOPE))
    full = priced_stream_decode(20.0, 50, 8, Policy.COST)  # a slot's wait is before token 1
    assert full == pytest.approx(20.0 / (1 + 8 * BATCH_STEP_SLOPE))
    assert priced_stream_decode(0.0, 3, 8, Policy.COST) == 0.0  # nothing claimed
    assert priced_stream_decode(20.0, -5, -1, Policy.COST) == 20.0  # garbage counts as idle


def test_a_claimed_load_excuses_nothing_where_the_policy_does_not_price_it():
    """Under longest_prefix a peer's claimed load does not make it dearer, so it cannot
    buy a slow decode either."""
    for policy in Policy:
        priced = priced_stream_decode(20.0, 1000, 0, policy)
        assert priced == (pytest.approx(20.0 / 1001) if policy in LOAD_PRICED else 20.0)


@given(st.floats(0.1, 1e9), st.integers(0, 10_000), st.integers(0, 64),
       st.sampled_from(list(Policy)))
def test_the_priced_decode_never_exceeds_the_claim(claim, running, slots, policy):
    priced = priced_stream_decode(claim, running, slots, policy)
    assert 0.0 < priced <= claim
    assert priced_stream_decode(claim, running + 1, slots, policy) <= priced


def test_the_ledger_charges_lapses_and_not_the_quarantined():
    ledger = _trusted("p")
    assert ledger.record_lapse("p", Lapse.HEDGE_LOST, 0.0) == HEDGE_LOST_CHARGE
    assert ledger.record_delivery("p", 1.2e8, 100.0, 0.0) == 1.0
    assert ledger.record_delivery("p", 20.0, 15.0, 0.0) == 0.0
    assert ledger.debt("p", 0.0) == pytest.approx(1.5)
    assert ledger.view("p").lapses == 2
    stats = ledger.statistics()
    assert stats["charged_hedge_lost"] == 1 and stats["charged_underdelivered"] == 1
    ledger.record_served("p", verified=False, now=0.0)
    assert ledger.debt("p", 0.0) == pytest.approx(1.25)
    ledger.quarantine("p", "x", 0.0)
    assert ledger.record_lapse("p", Lapse.STALLED, 1.0) == 0.0
