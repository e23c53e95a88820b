"""The providers discovery dials (peer/net/dial_candidates.py): a flood of fake provider
records costs a bounded number of dials, expires, and never keeps a real peer waiting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.net.dial_candidates import (
    CANDIDATE_TTL_S,
    DIAL_BURST,
    DIALS_PER_S,
    LOCAL_SOURCE,
    MAX_NAMED_PER_SOURCE,
    UNREACHABLE_S,
    CandidateBook,
    Dial,
)

ROGUE = "Rogue"
HONEST = "Honest"


def never(peer: str) -> bool:
    return False


def test_one_source_names_at_most_its_share_of_strangers() -> None:
    book: CandidateBook[str] = CandidateBook()
    named = [book.learn(f"Fake{i}", "addr", ROGUE, 0.0) for i in range(1024)]
    assert sum(named) == MAX_NAMED_PER_SOURCE
    assert book.learn("Late", "addr", HONEST, 0.0)  # another source is not crowded out
    assert book.learn("Fake500", "addr", HONEST, 0.0)  # named by a second source: taken


def test_dials_come_from_a_budget_and_the_best_named_first() -> None:
    book: CandidateBook[str] = CandidateBook()
    for i in range(200):
        book.learn(f"Fake{i}", "addr", f"Rogue{i // MAX_NAMED_PER_SOURCE}", 0.0)
    book.learn("Late", "late-addr", LOCAL_SOURCE, 0.0)  # it announced itself to us
    book.learn("Late", "late-addr", HONEST, 0.0)
    first = book.due(0.0, never)
    assert len(first) == DIAL_BURST
    assert first[0] == Dial("Late", "late-addr")  # two sources, one of them its own word
    assert book.due(0.0, never) == []  # the burst is spent
    assert len(book.due(1.0, never)) == DIALS_PER_S  # then DIALS_PER_S a second


def test_a_flood_of_unreachable_providers_costs_bounded_dials() -> None:
    """1,024 fake providers named again every round: over ten minutes each is dialled at
    most twice, then not taken back, and all dials fit the budget."""
    book: CandidateBook[str] = CandidateBook()
    dials = 0
    now = 0.0
    while now < 600.0:
        for i in range(1024):
            book.learn(f"Fake{i}", "addr", f"Rogue{i % 64}", now)  # 64 lying sources
        for dial in book.due(now, never):
            dials += 1
            book.dial_failed(dial.peer_id, now)
        now += 0.5
    assert dials <= DIAL_BURST + DIALS_PER_S * 600.0
    assert dials <= 2 * 1024
    stats = book.statistics()
    assert stats["dropped_unreachable"] >= 1
    assert stats["ignored_unreachable"] > 0


def test_a_source_of_fakes_loses_its_share() -> None:
    """One peer names 1,024 fake providers every round for ten minutes: its first 20 are
    dialled twice each, and then it names nothing we take; an honest newcomer named by
    another peer is still dialled at once."""
    book: CandidateBook[str] = CandidateBook()
    dialled: list[str] = []
    linked: set[str] = set()
    now = 0.0
    while now < UNREACHABLE_S - 1.0:
        for i in range(1024):
            book.learn(f"Fake{i}", "addr", ROGUE, now)
        if now == 300.0:
            book.learn("Late", "addr", HONEST, now)
        for dial in book.due(now, linked.__contains__):
            dialled.append(dial.peer_id)
            if dial.peer_id != "Late":
                book.dial_failed(dial.peer_id, now)
            else:
                linked.add("Late")
        now += 0.5
    fakes = [p for p in dialled if p != "Late"]
    assert len(fakes) == 2 * MAX_NAMED_PER_SOURCE
    assert dialled.count("Late") == 1
    assert book.statistics()["ignored_source_cap"] > 0


def test_an_unproven_provider_is_dropped_after_two_failures_and_ignored_a_while() -> None:
    book: CandidateBook[str] = CandidateBook()
    book.learn("Ghost", "addr", HONEST, 0.0)
    assert book.dial_failed("Ghost", 0.0) == 1
    assert "Ghost" in book and book.due(0.5, never) == []  # backing off a second
    assert [d.peer_id for d in book.due(1.0, never)] == ["Ghost"]
    assert book.dial_failed("Ghost", 1.0) == 2
    assert "Ghost" not in book
    assert not book.learn("Ghost", "addr", HONEST, 2.0)
    assert book.learn("Ghost", "addr", HONEST, 1.0 + UNREACHABLE_S)


def test_a_provider_that_announced_itself_is_kept_through_failed_dials() -> None:
    """A record in our own store was sent by its provider (a swarm starting: dials race
    and fail): it backs off, it is not dropped like hearsay."""
    book: CandidateBook[str] = CandidateBook()
    book.learn("Starting", "addr", LOCAL_SOURCE, 0.0)
    for now in (0.0, 1.0, 3.0, 7.0):
        assert [d.peer_id for d in book.due(now, never)] == ["Starting"]
        book.dial_failed("Starting", now)
    assert "Starting" in book and book.failures("Starting") == 4


def test_a_proven_provider_is_kept_and_backed_off_to_a_minute() -> None:
    book: CandidateBook[str] = CandidateBook()
    book.learn("Peer", "addr", LOCAL_SOURCE, 0.0)
    assert book.due(0.0, lambda p: p == "Peer") == []  # connected: proven, no dial
    now, gaps, last = 0.0, [], 0.0
    while now < 600.0:
        book.learn("Peer", "addr", LOCAL_SOURCE, now)  # still in our provider store
        if book.due(now, never):
            gaps.append(now - last)
            last = now
            book.dial_failed("Peer", now)
        now += 1.0
    assert "Peer" in book
    assert max(gaps) == 60.0 and len(gaps) < 20


def test_candidates_no_one_names_expire_unless_connected() -> None:
    book: CandidateBook[str] = CandidateBook()
    book.learn("Quiet", "addr", HONEST, 0.0)
    book.learn("Linked", "addr", HONEST, 0.0)
    gone = book.expire(CANDIDATE_TTL_S, lambda p: p == "Linked")
    assert gone == ["Quiet"] and "Linked" in book


def test_a_full_book_drops_its_worst_unproven_candidate_for_a_newcomer() -> None:
    book: CandidateBook[str] = CandidateBook(max_candidates=3)
    book.learn("A", "a", "S1", 0.0)
    book.learn("B", "b", "S2", 0.0)
    book.learn("C", "c", LOCAL_SOURCE, 0.0)
    book.due(0.0, lambda p: p == "C")  # C proven
    book.dial_failed("A", 0.0)  # A failed once: ranked last
    assert book.learn("D", "d", "S3", 0.0)
    assert "A" not in book and {"B", "C", "D"} <= {p for p in "BCD" if p in book}


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        CandidateBook(max_candidates=0)
    with pytest.raises(ValueError):
        CandidateBook(dials_per_s=0.0)
    with pytest.raises(ValueError):
        CandidateBook().due(float("nan"), never)


_step = st.tuples(
    st.sampled_from(["learn", "due", "fail", "connect", "wait"]),
    st.integers(0, 30),
    st.integers(0, 4),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=80))
def test_book_bounds_hold_under_any_events(steps) -> None:
    """Any mix of records, dials, failures, connections and waits: the book never holds
    more than its bound, one source never names more than its share alone, and dials
    never exceed the token bucket."""
    book: CandidateBook[str] = CandidateBook(max_candidates=16)
    connected: set[str] = set()
    now, dialled = 0.0, 0
    for op, n, source in steps:
        peer = f"P{n}"
        if op == "learn":
            book.learn(peer, "addr", f"S{source}" if source else LOCAL_SOURCE, now)
        elif op == "due":
            dialled += len(book.due(now, connected.__contains__))
        elif op == "fail":
            book.dial_failed(peer, now)
        elif op == "connect":
            connected.add(peer)
            book.connected(peer)
        else:
            now += 7.5
        assert len(book) <= 16
        assert all(count <= MAX_NAMED_PER_SOURCE for count in book._named.values())
        assert dialled <= DIAL_BURST + DIALS_PER_S * now
