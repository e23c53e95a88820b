"""A full peer table admits proven peers before unproven ones (peer/swarm/admission.py):
forged-but-signed summaries of identities never reached fill at most their share, and a
peer that was reached always gets a slot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.swarm.admission import Admission, Decision, decide
from peer.swarm.peer_table import MAX_PEERS, PeerTable, Verdict
from tests.test_peer_table import EXPIRY, MODEL, SELF, summary


def test_decide() -> None:
    free = {"size": 3, "max_peers": 4, "max_unproven": 1}
    assert decide(proven=False, unproven={}, **free) == Decision(Admission.ADMIT)
    assert decide(proven=False, unproven={"u": 0.0}, **free).action is Admission.UNPROVEN_FULL
    assert decide(proven=True, unproven={"u": 0.0}, **free) == Decision(Admission.ADMIT)
    full = {"size": 4, "max_peers": 4, "max_unproven": 2}
    assert decide(proven=False, unproven={}, **full).action is Admission.TABLE_FULL
    assert decide(proven=True, unproven={}, **full).action is Admission.TABLE_FULL
    stalest = decide(proven=True, unproven={"b": 2.0, "a": 1.0, "c": 1.0}, **full)
    assert stalest == Decision(Admission.ADMIT_EVICTING, "a")  # oldest, then lowest id
    with pytest.raises(ValueError):
        decide(proven=True, unproven={}, size=1, max_peers=4, max_unproven=5)
    with pytest.raises(ValueError):
        decide(proven=True, unproven={"a": 0.0, "b": 0.0}, size=1, max_peers=4, max_unproven=2)


def test_forged_summaries_fill_only_their_share_and_a_late_honest_peer_gets_in() -> None:
    """256 signed summaries of identities never reached, kept fresh: 64 slots at most;
    192 honest peers (reached) still fit, and once the table is full a late honest peer
    takes the slot of the stalest forged entry, which expire() reports."""
    t = PeerTable(SELF, MODEL, 16, EXPIRY)
    now = 0.0
    for rnd in range(3):  # kept fresh: every forged identity publishes again
        now = rnd * 1.0
        verdicts = [
            t.apply(summary(f"Forged{i}", seq=rnd + 1), f"Forged{i}", now + i * 1e-4).reason
            for i in range(256)
        ]
        assert verdicts.count(Verdict.UNPROVEN_FULL) == 256 - 64
    assert t.statistics()["unproven"] == 64
    for i in range(MAX_PEERS - 64):
        assert t.apply(summary(f"Honest{i}"), f"Honest{i}", now, reachable=True).accepted
    assert len(t) == MAX_PEERS
    late = t.apply(summary("Late"), "Late", now + 0.5, reachable=True)
    assert late.accepted and late.reason is Verdict.NEW_PEER
    assert t.expire(now + 0.5) == ["Forged0"]  # the stalest unproven entry made way
    assert t.statistics()["evicted_unproven"] == 1
    # Forged identities cannot take the slot back: the table is full of unproven share
    again = t.apply(summary("Forged0", seq=9), "Forged0", now + 0.6)
    assert again.reason is Verdict.TABLE_FULL


def test_a_round_trip_proves_an_entry_and_frees_its_unproven_slot() -> None:
    t = PeerTable(SELF, MODEL, 16, EXPIRY, max_peers=4, max_unproven=1)
    assert t.apply(summary("First"), "First", 0.0).accepted  # its summary outran the dial
    assert t.apply(summary("Second"), "Second", 0.0).reason is Verdict.UNPROVEN_FULL
    assert t.record_rtt("First", 0.01, 0.5)
    assert t.apply(summary("Second"), "Second", 1.0).accepted  # the share is free again
    assert t.apply(summary("Second", seq=2), "Second", 1.5, reachable=True).accepted
    assert t.statistics()["unproven"] == 0


def test_silent_unproven_entries_expire_and_free_the_share() -> None:
    t = PeerTable(SELF, MODEL, 16, EXPIRY, max_peers=4, max_unproven=1)
    assert t.apply(summary("Ghost"), "Ghost", 0.0).accepted
    assert t.apply(summary("Other"), "Other", EXPIRY - 0.1).reason is Verdict.UNPROVEN_FULL
    assert t.apply(summary("Other"), "Other", EXPIRY).accepted  # Ghost went silent
    assert "Ghost" in t.expire(EXPIRY)


_event = st.tuples(
    st.sampled_from(["unproven", "reachable", "rtt", "silence"]), st.integers(0, 11)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=60), st.integers(1, 6), st.integers(0, 6))
def test_proven_peers_always_get_a_slot(events, max_peers, max_unproven) -> None:
    """Through any mix of summaries from peers reached or not, round trips and silences:
    the table never holds more than max_peers entries nor more than max_unproven
    unproven ones, a reached newcomer is refused only by a table full of peers that
    were all reached, and room_for_unproven is False only when the table would refuse a
    new unproven peer (what the gossip gate drops unchecked)."""
    max_unproven = min(max_unproven, max_peers)
    t = PeerTable(SELF, MODEL, 16, EXPIRY, max_peers=max_peers, max_unproven=max_unproven)
    seqs: dict[str, int] = {}
    now = 0.0
    for kind, n in events:
        peer = f"P{n}"
        if kind == "silence":
            now += EXPIRY / 2
            t.expire(now)
            continue
        if kind == "rtt":
            t.record_rtt(peer, 0.01, now)
        else:
            seqs[peer] = seqs.get(peer, 0) + 1
            known = t.get(peer, now) is not None
            held = t.holds(peer)
            assert held or not known
            room = t.room_for_unproven(now)
            proven_before = len(t.views(now)) - t.statistics()["unproven"]
            result = t.apply(summary(peer, seqs[peer]), peer, now, reachable=kind == "reachable")
            if kind == "reachable" and not known:
                assert result.accepted or (
                    result.reason is Verdict.TABLE_FULL and proven_before >= max_peers
                ), result
            if kind == "unproven" and not known and result.accepted:
                assert t.statistics()["unproven"] <= max_unproven
            if kind == "unproven" and not held and not room:  # the gossip gate drops it
                assert result.reason in (Verdict.UNPROVEN_FULL, Verdict.TABLE_FULL), result
        assert len(t) <= max_peers
        assert t.statistics()["unproven"] <= max_unproven
        now += 0.1
