"""Load probing's pure core (peer/routing/probing.py), the router's rerank and the load protocol's
codec: whom to probe, how long to wait, and what an answer may change."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.cost import PeerEstimate, rank_estimates
from peer.routing.probing import (
    MAX_PROBES,
    NO_PROBE,
    PROBE_ROUND_TRIPS,
    PROBE_WAIT_BOUND_S,
    ProbePlan,
    ProbeRound,
    ProbeSettings,
    ProbeWaits,
    fresh_estimate,
    plan_probes,
)
from peer.routing.router import Router
from peer.routing.trust import TrustLedger
from protocols.errors import RemoteProtocolError
from protocols.framing import decode_cbor, encode_cbor
from protocols.load import (
    MAX_LOAD_COUNT,
    LoadQuery,
    LoadReport,
    decode_load_query,
    decode_load_report,
)
from tests.test_router import BS, NEW, chain_of, me, summary, table_with

PROMPT_BLOCKS = 40


def estimate(
    peer_id: str,
    *,
    local: bool = False,
    match: int = 0,
    queued: int = 0,
    running: int = 0,
    rtt: float = 0.002,
    failed: float | None = None,
) -> PeerEstimate:
    return PeerEstimate(
        peer_id,
        local,
        match,
        match * BS,
        queued,
        running,
        1000.0,
        20.0,
        0.0 if local else rtt,
        failed_s_ago=failed,
    )


def ranking(estimates: list[PeerEstimate], policy: Policy = Policy.COST):
    return rank_estimates(policy, estimates, PROMPT_BLOCKS * BS, NEW, random.Random(0))


# -- plan_probes ---------------------------------------------------------------------------


def test_a_busy_peer_that_would_win_if_idle_is_probed_for_as_long_as_it_could_save():
    # A holds the whole prefix but gossips 6 running requests; B holds half and is idle.
    ranked = ranking(
        [estimate("me", local=True), estimate("A", match=39, running=6), estimate("B", match=20)]
    )
    assert [c.peer_id for c in ranked] == ["B", "me", "A"]
    best, a = ranked[0], ranked[2]
    plan = plan_probes(ranked, ProbeSettings(max_probes=1))
    assert plan.peers == ("A",)
    gain = best.cost_s - (a.cost_s - a.queue_s)
    assert plan.gains_s == (pytest.approx(gain),)
    assert plan.wait_s == pytest.approx(min(0.25, gain, max(0.02, 4 * 0.002)))


@pytest.mark.parametrize("rtt", [0.2, 1.2])
def test_no_probe_when_the_round_trips_cost_more_than_any_answer_could_save(rtt):
    ranked = ranking(
        [
            estimate("me", local=True),
            estimate("A", match=39, running=6, rtt=rtt),
            estimate("B", match=20, rtt=rtt),
        ]
    )
    me_, a = ranked[0], next(c for c in ranked if c.peer_id == "A")
    gain = me_.cost_s - (a.cost_s - a.queue_s)  # A idle would save this much
    # (no cost budget here: the gain rule alone; the budget has its own test)
    plan = plan_probes(ranked, ProbeSettings(cost_fraction=math.inf))
    if gain > PROBE_ROUND_TRIPS * rtt:
        assert rtt == 0.2 and plan.peers == ("A",)
    else:
        assert rtt == 1.2 and plan == NO_PROBE


def test_no_probe_that_costs_more_than_its_share_of_the_request():
    """cost_fraction: the probe's round trips may be at most that share of the best's
    estimated cost, whatever an answer could gain."""
    ranked = ranking(
        [
            estimate("me", local=True),
            estimate("A", match=39, running=6, rtt=0.002),
            estimate("B", match=20, rtt=0.002),
        ]
    )
    top = ranked[0].cost_s
    share = PROBE_ROUND_TRIPS * 0.002 / top
    assert plan_probes(ranked, ProbeSettings(cost_fraction=share * 1.01)).probes
    assert plan_probes(ranked, ProbeSettings(cost_fraction=share * 0.99)) == NO_PROBE
    assert ProbeSettings().cost_fraction == 0.05
    with pytest.raises(ValueError, match="cost_fraction"):
        ProbeSettings(cost_fraction=-0.1)


def test_no_probe_when_the_best_wins_by_a_wide_margin():
    # The entry peer holds the prefix and is idle: nobody can beat it, even idle.
    ranked = ranking(
        [
            estimate("me", local=True, match=39),
            estimate("A", match=1, running=2),
            estimate("B", match=0),
        ]
    )
    assert ranked[0].is_local
    assert plan_probes(ranked, ProbeSettings()) == NO_PROBE


def test_no_probe_under_other_policies_or_when_turned_off():
    peers = [
        estimate("me", local=True),
        estimate("A", match=39, running=6),
        estimate("B", match=20),
    ]
    assert plan_probes(ranking(peers, Policy.LONGEST_PREFIX), ProbeSettings()) == NO_PROBE
    assert plan_probes(ranking(peers), ProbeSettings(max_probes=0)) == NO_PROBE


def test_a_peer_that_failed_recently_is_not_probed():
    ranked = ranking(
        [
            estimate("me", local=True),
            estimate("A", match=39, running=6, failed=1.0),
            estimate("B", match=20),
        ]
    )
    assert "A" not in plan_probes(ranked, ProbeSettings()).peers


def test_a_probe_costs_its_round_trips_and_what_this_entrys_rounds_waited_beyond_them():
    ranked = ranking(
        [estimate("me", local=True), estimate("A", match=39, running=6), estimate("B", match=20)]
    )
    a = next(c for c in ranked if c.peer_id == "A")
    gain = ranked[0].cost_s - (a.cost_s - a.queue_s)
    trips = PROBE_ROUND_TRIPS * 0.002
    free = ProbeSettings(cost_fraction=math.inf)
    assert plan_probes(ranked, free).rtt_s == 0.002
    assert plan_probes(ranked, free, (gain - trips) * 0.99).peers == ("A",)
    assert plan_probes(ranked, free, (gain - trips) * 1.01) == NO_PROBE  # the wait eats it
    late = gain * 0.5
    share = (trips + late) / ranked[0].cost_s  # and within the cost budget:
    assert plan_probes(ranked, ProbeSettings(cost_fraction=share * 1.01), late).probes
    assert plan_probes(ranked, ProbeSettings(cost_fraction=share * 0.99), late) == NO_PROBE


def test_probe_waits_learns_a_rounds_wait_beyond_its_round_trips_and_forgets_it():
    waits = ProbeWaits(weight=0.1)
    assert waits.late_s == 0.0
    rtt = 0.002
    waits.waited(PROBE_ROUND_TRIPS * rtt + 0.02, rtt)
    waits.waited(PROBE_ROUND_TRIPS * rtt + 0.04, rtt)
    assert waits.late_s == pytest.approx(0.03)  # a plain mean of the first ones
    for _ in range(200):
        waits.waited(PROBE_ROUND_TRIPS * rtt * 0.5, rtt)  # on time: nothing beyond the model
    assert waits.late_s == pytest.approx(0.0, abs=1e-9)
    waits.waited(1e6, rtt)  # one round counts at most the bound
    assert 0 < waits.late_s <= 0.1 * PROBE_WAIT_BOUND_S + 1e-9
    before = waits.late_s
    waits.not_probed()
    assert waits.late_s == pytest.approx(before * 0.99)
    assert waits.statistics()["probe_rounds_seen"] == 203
    for bad in ((-1.0, rtt), (math.nan, rtt), (0.01, -rtt)):
        with pytest.raises(ValueError):
            waits.waited(*bad)
    with pytest.raises(ValueError):
        ProbeWaits(weight=0.0)


def test_settings_are_validated():
    with pytest.raises(ValueError):
        ProbeSettings(max_probes=MAX_PROBES + 1)
    with pytest.raises(ValueError):
        ProbeSettings(max_wait_s=-1.0)
    with pytest.raises(ValueError):
        ProbeSettings(min_wait_s=1.0, max_wait_s=0.5)
    with pytest.raises(ValueError):
        ProbeSettings(margin_fraction=math.nan)


peer_estimates = st.lists(
    st.tuples(
        st.integers(0, PROMPT_BLOCKS - 1),  # match blocks
        st.integers(0, 5000),  # queued tokens
        st.integers(0, 30),  # running
        st.floats(0.0, 0.3),  # rtt
        st.one_of(st.none(), st.floats(0.0, 5.0)),  # failed s ago
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    peer_estimates,
    st.integers(0, PROMPT_BLOCKS - 1),
    st.integers(0, 10),
    st.integers(0, MAX_PROBES),
    st.floats(0.0, 2.0),
    st.floats(0.0, 3.0),
    st.floats(0.0, 1.0),
)
def test_plan_properties(rows, local_match, local_running, k, max_wait, margin, budget):
    """Never more than k probes, only remote healthy candidates, each worth its round
    trips and within the cost budget, and a wait within max_wait_s and within the most
    an answer could save."""
    estimates = [estimate("me", local=True, match=local_match, running=local_running)]
    estimates += [
        estimate(f"p{i}", match=m, queued=q, running=r, rtt=rtt, failed=f)
        for i, (m, q, r, rtt, f) in enumerate(rows)
    ]
    ranked = ranking(estimates)
    plan = plan_probes(
        ranked,
        ProbeSettings(
            max_probes=k,
            max_wait_s=max_wait,
            min_wait_s=min(0.02, max_wait),
            margin_fraction=margin,
            cost_fraction=budget,
        ),
    )
    assert len(plan.peers) <= k
    assert len(set(plan.peers)) == len(plan.peers) == len(plan.gains_s)
    by_id = {c.peer_id: c for c in ranked}
    for peer_id, gain in zip(plan.peers, plan.gains_s, strict=True):
        c = by_id[peer_id]
        assert not c.is_local and c.estimate.failed_s_ago is None
        assert gain > PROBE_ROUND_TRIPS * c.estimate.rtt_s
        assert PROBE_ROUND_TRIPS * c.estimate.rtt_s <= budget * ranked[0].cost_s
    if plan.peers:
        assert 0 <= plan.wait_s <= max_wait
        assert plan.wait_s <= max(plan.gains_s)
    else:
        assert plan.wait_s == 0.0


# -- ProbeRound ----------------------------------------------------------------------------

REPORT = LoadReport(0, 0)


def test_a_round_keeps_one_answer_per_asked_peer_until_its_deadline():
    probe = ProbeRound(ProbePlan(("A", "B"), 0.05, (0.1, 0.1)), started_at=10.0)
    assert probe.deadline == pytest.approx(10.05)
    assert not probe.offer("C", REPORT, 10.01)  # never asked
    assert probe.offer("A", REPORT, 10.01)
    assert not probe.offer("A", LoadReport(5, 5), 10.02)  # a second answer
    assert not probe.done
    assert not probe.offer("B", REPORT, 10.0501)  # late
    assert probe.reports == {"A": REPORT} and probe.late == 1 and probe.unasked == 2


def test_a_round_never_outlives_the_request():
    probe = ProbeRound(ProbePlan(("A",), 0.25, (1.0,)), started_at=0.0, not_after=0.1)
    assert probe.deadline == 0.1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from("ABCDE"), min_size=1, max_size=4, unique=True),
    st.floats(0.0, 1.0),
    st.lists(st.tuples(st.sampled_from("ABCDEF"), st.floats(0.0, 2.0)), max_size=20),
)
def test_round_properties(asked, wait, offers):
    probe = ProbeRound(ProbePlan(tuple(asked), wait, tuple(1.0 for _ in asked)), 0.0)
    kept: dict[str, float] = {}
    for peer_id, at in offers:
        expected = peer_id in asked and peer_id not in kept and at <= wait
        assert probe.offer(peer_id, REPORT, at) == expected
        if expected:
            kept[peer_id] = at
    assert set(probe.reports) == set(kept)
    assert probe.done == (len(kept) == len(asked))


# -- fresh_estimate and rerank -------------------------------------------------------------


def test_a_report_lowers_the_load_no_further_than_our_own_forwards_there():
    e = estimate("A", match=10, queued=900, running=9)
    fresh = fresh_estimate(e, LoadReport(0, 0), own_forwards=3, own_tokens=120)
    assert (fresh.queued_prompt_tokens, fresh.running_requests) == (120, 3)
    higher = fresh_estimate(e, LoadReport(5000, 40), own_forwards=3, own_tokens=120)
    assert (higher.queued_prompt_tokens, higher.running_requests) == (5000, 40)
    assert fresh._replace(queued_prompt_tokens=900, running_requests=9) == e


def trusted_ledger(*peer_ids: str) -> TrustLedger:
    ledger = TrustLedger()
    for peer_id in peer_ids:
        for _ in range(ledger.probation_requests):
            ledger.record_served(peer_id, verified=True)
    return ledger


def test_a_lie_in_a_probe_wins_no_more_than_the_same_lie_in_a_summary():
    """A gossips 8 running (honest) but answers the probe with 0; this peer has 4 forwards
    in flight there. The ranking equals the one where A's summary claimed 0 instead."""
    chain = chain_of(PROMPT_BLOCKS)

    def swarm(gossiped_running: int):
        table = table_with(summary("A", chain, running=gossiped_running), summary("B", chain[:20]))
        for peer_id in ("A", "B"):
            table.record_rtt(peer_id, 0.002, 0.0)
        for _ in range(4):
            table.record_forward("A", 10, 0.0)
        r = Router(
            Policy.COST,
            random.Random(0),
            block_size=BS,
            trust=trusted_ledger("A", "B"),
            require_rtt=True,
        )
        return r, table, r.rank(chain, PROMPT_BLOCKS * BS, NEW, me(), table, 0.0)

    r, table, ranked = swarm(8)
    again = r.rerank(ranked, {"A": LoadReport(0, 0)}, table, 0.0)
    _, _, lied_in_summary = swarm(0)
    assert [
        (c.peer_id, c.estimate.running_requests, c.estimate.queued_prompt_tokens) for c in again
    ] == [
        (c.peer_id, c.estimate.running_requests, c.estimate.queued_prompt_tokens)
        for c in lied_in_summary
    ]
    assert [c.cost_s for c in again] == pytest.approx([c.cost_s for c in lied_in_summary])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, PROMPT_BLOCKS), st.integers(0, 20)), min_size=1, max_size=6),
    st.sets(st.integers(0, 7), max_size=4),  # quarantined, before and during the probe
    st.dictionaries(
        st.integers(0, 7), st.tuples(st.integers(0, 10**6), st.integers(0, 100)), max_size=8
    ),  # reports, from candidates and from anyone else
)
def test_a_probe_answer_never_makes_a_peer_eligible(peers, quarantined, reports):
    chain = chain_of(PROMPT_BLOCKS)
    names = [f"peer{i}" for i in range(len(peers))]
    table = table_with(
        *(summary(n, chain[:m], running=r) for n, (m, r) in zip(names, peers, strict=True))
    )
    proven = names[::2]  # the others never completed a round trip: never candidates
    for n in proven:
        table.record_rtt(n, 0.002, 0.0)
    ledger = trusted_ledger(*names)
    before = {f"peer{i}" for i in quarantined if i % 2 == 0}
    for n in before:
        ledger.quarantine(n, "wrong tokens", 0.0)
    r = Router(Policy.COST, random.Random(0), block_size=BS, trust=ledger, require_rtt=True)
    ranked = r.rank(chain, PROMPT_BLOCKS * BS, NEW, me(), table, 0.0)
    for n in {f"peer{i}" for i in quarantined} - before:
        ledger.quarantine(n, "wrong tokens", 0.5)  # caught while the probes were out
    answers = {f"peer{i}": LoadReport(q, run) for i, (q, run) in reports.items()}
    again = r.rerank(ranked, answers, table, 1.0)
    ids = [c.peer_id for c in again]
    assert set(ids) <= {c.peer_id for c in ranked}
    assert not set(ids) & {f"peer{i}" for i in quarantined}
    assert sum(c.is_local for c in again) == 1


# -- the wire ------------------------------------------------------------------------------


def test_report_and_query_round_trip():
    report = LoadReport(123, 4, 2)
    assert decode_load_report(decode_cbor(encode_cbor(report.to_wire()))) == report
    assert decode_load_query(decode_cbor(encode_cbor(LoadQuery().to_wire()))) == LoadQuery()


@pytest.mark.parametrize(
    "wire",
    [
        {"t": "load_report", "v": 1, "queued_prompt_tokens": -1, "running_requests": 0},
        {
            "t": "load_report",
            "v": 1,
            "queued_prompt_tokens": MAX_LOAD_COUNT + 1,
            "running_requests": 0,
        },
        {"t": "load_report", "v": 1, "queued_prompt_tokens": 1.5, "running_requests": 0},
        {"t": "load_report", "v": 1, "queued_prompt_tokens": True, "running_requests": 0},
        {"t": "load_report", "v": 1, "running_requests": 0},
        {"t": "load_report", "v": 2, "queued_prompt_tokens": 0, "running_requests": 0},
        {"t": "load_query", "v": 1},
        [1, 2],
    ],
)
def test_bad_reports_are_remote_protocol_errors(wire):
    with pytest.raises(RemoteProtocolError):
        decode_load_report(decode_cbor(encode_cbor(wire)))


def test_unknown_keys_are_ignored():
    wire = {**LoadReport(1, 2).to_wire(), "batch_tokens_per_s": 5.0}
    assert decode_load_report(wire) == LoadReport(1, 2)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_give_a_report_or_a_remote_protocol_error(data):
    try:
        obj = decode_cbor(data)
        decode_load_report(obj)
        decode_load_query(obj)
    except RemoteProtocolError:
        pass
