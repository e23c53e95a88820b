"""Shadow verification (pure): a peer on probation never serves a client; copies of
requests served anyway make it trusted after K matches or quarantine it on a difference;
the copies are bounded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.config import Policy
from peer.routing.router import Router
from peer.routing.shadow import Shadow, ShadowPlanner, comparable, first_difference
from peer.routing.trust import Promote, Quarantine, TrustLedger, TrustState
from tests.test_router import BS, SELF, chain_of, me, summary, table_with

NEW = 16
CHAIN = chain_of(40)


def swarm(peers: list[str], ledger: TrustLedger):
    """A router over ``peers`` (each holding a different share of CHAIN, all reachable)."""
    table = table_with(*(summary(p, CHAIN[: 3 * i + 1]) for i, p in enumerate(peers)))
    for p in peers:
        table.record_rtt(p, 0.002, 0.0)
    return Router(Policy.COST, random.Random(0), block_size=BS, trust=ledger,
                  require_rtt=True), table


def rank_all(router: Router, table, now: float = 0.0):
    return router.rank_all(CHAIN, 40 * BS, NEW, me(), table, now)


def test_comparable_answers_are_greedy_or_seeded_ones():
    assert comparable(0.0)
    assert not comparable(0.7) and not comparable(1.0)
    assert comparable(0.7, seed=3) and comparable(1.0, seed=0)


@pytest.mark.parametrize(("a", "b", "at"), [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2),
    ([1, 2, 3], [1, 2], 2), ([], [], None), ([], [4], 0),
])  # fmt: skip
def test_first_difference(a, b, at):
    assert first_difference(a, b) == at


def test_k_matches_make_a_newcomer_trusted_and_then_a_candidate():
    ledger = TrustLedger(probation_requests=3)
    router, table = swarm(["new"], ledger)
    planner = ShadowPlanner(ledger)
    for k in range(3):
        ranked = rank_all(router, table)
        assert ids(ranked.candidates) == [SELF]
        shadow = planner.choose(ranked.probation, temperature=0.0, private=False)
        assert shadow == Shadow("new", k + 1)
        assert planner.choose(ranked.probation, temperature=0.0, private=False) is None  # busy
        assert planner.matched(shadow) == (Promote("new", 3) if k == 2 else None)
    ranked = rank_all(router, table)
    assert ids(ranked.candidates)[0] == "new" and ranked.probation == []
    assert planner.statistics() == {"shadow_sent": 3, "shadow_matched": 3,
                                    "shadow_skipped_busy": 3, "shadows_in_flight": 0}


def test_a_difference_quarantines_for_good():
    ledger = TrustLedger(probation_requests=3)
    router, table = swarm(["liar"], ledger)
    planner = ShadowPlanner(ledger)
    shadow = planner.choose(rank_all(router, table).probation, temperature=0.0, private=False)
    assert shadow is not None
    planner.matched(shadow)
    shadow = planner.choose(rank_all(router, table).probation, temperature=0.0, private=False)
    action = planner.mismatched(shadow, "token 4", now=7.0)
    assert action == Quarantine("liar", "shadow answer differs: token 4", 7.0)
    assert ledger.view("liar").state is TrustState.QUARANTINED
    ranked = rank_all(router, table)
    assert ids(ranked.candidates) == [SELF] and ranked.probation == []


def test_private_or_unseeded_requests_carry_no_shadow_and_a_failed_peer_waits():
    ledger = TrustLedger()
    router, table = swarm(["a", "b"], ledger)
    planner = ShadowPlanner(ledger)
    probation = rank_all(router, table).probation
    assert ids(probation) == ["b", "a"]  # b claims more of the prompt: cheaper
    assert planner.choose(probation, temperature=0.0, private=True) is None
    assert planner.choose(probation, temperature=0.7, private=False) is None
    assert planner.choose(probation, temperature=0.7, private=True, seed=5) is None
    router.record_outcome("b", False, 0.0)  # backed off: a is shadowed instead
    probation = rank_all(router, table, 1.0).probation
    assert planner.choose(probation, temperature=1.0, private=False, seed=5).peer_id == "a"
    with pytest.raises(ValueError):
        planner.ended(Shadow("b", 99), failed=True)


# One step of a random run: a request (with a subset of the peers on probation for it),
# or the end of one of the shadows in flight (a match, a difference, a failure).
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.lists(st.integers(0, 7), max_size=8, unique=True),
                  st.sampled_from([0.0, 0.0, 1.0]), st.booleans()),
        st.tuples(st.sampled_from(["match", "differ", "inconclusive", "fail", "abandon"]),
                  st.integers(0, 7)),
    ),
    max_size=60,
)


@given(STEPS, st.integers(1, 4), st.integers(0, 3), st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_shadows_are_bounded_and_verdicts_are_the_ledgers(steps, share, limit, k):
    peers = [f"p{i}" for i in range(8)]
    ledger = TrustLedger(probation_requests=k)
    router, table = swarm(peers, ledger)
    planner = ShadowPlanner(ledger, share=share, max_in_flight=limit)
    in_flight: dict[str, Shadow] = {}
    matches = dict.fromkeys(peers, 0)
    requests_with_probation = sent = 0
    for now, step in enumerate(steps):
        ranked = rank_all(router, table, float(now))
        # A peer on probation never serves a client; every other live one may.
        for c in ranked.candidates:
            assert c.is_local or ledger.view(c.peer_id).state is TrustState.TRUSTED
        for c in ranked.probation:
            assert ledger.view(c.peer_id).state is TrustState.PROBATION
        if step[0] == "request":
            _, subset, temperature, private = step
            offered = [c for c in ranked.probation if int(c.peer_id[1:]) in subset]
            shadow = planner.choose(offered, temperature=temperature, private=private)
            if offered and temperature == 0.0 and not private:
                requests_with_probation += 1
            if shadow is None:
                continue
            sent += 1
            assert temperature == 0.0 and not private
            assert shadow.peer_id in {c.peer_id for c in offered}
            assert shadow.peer_id not in in_flight  # one in flight per peer
            in_flight[shadow.peer_id] = shadow
            assert planner.in_flight == len(in_flight) <= limit  # and a global bound
            assert sent <= -(-requests_with_probation // share)  # one request in `share`
            continue
        kind, index = step
        if not in_flight:
            continue
        shadow = in_flight.pop(sorted(in_flight)[index % len(in_flight)])
        if kind == "match":
            promoted = planner.matched(shadow)
            matches[shadow.peer_id] += 1
            assert (promoted is not None) == (matches[shadow.peer_id] == k)
            assert ledger.on_probation(shadow.peer_id) == (matches[shadow.peer_id] < k)
        elif kind == "differ":
            assert planner.mismatched(shadow, "x", float(now)) is not None
            assert ledger.view(shadow.peer_id).state is TrustState.QUARANTINED
        elif kind == "inconclusive":  # differs, but the verifier accepts it: no credit
            planner.inconclusive(shadow)
            assert ledger.on_probation(shadow.peer_id) == (matches[shadow.peer_id] < k)
            assert ledger.routable(shadow.peer_id)
        else:
            planner.ended(shadow, failed=kind == "fail")
        assert planner.in_flight == len(in_flight)


def ids(candidates) -> list[str]:
    return [c.peer_id for c in candidates]
