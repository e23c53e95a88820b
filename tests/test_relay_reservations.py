"""Relay reservations (peer/net/relay_reservations.py): bounded in total and per source,
expiring, and not held forever against newcomers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.net.relay_reservations import Granted, Refused, ReservationBook, ReservationRules

RULES = ReservationRules(max_total=4, max_per_source=2, ttl_s=10.0, max_hold_s=100.0)


def test_a_reservation_lapses_unless_refreshed():
    book = ReservationBook(RULES)
    assert book.reserve("a", "10.0.0.1", 0.0) == Granted(10.0)
    assert book.holds("a", 9.9) and not book.holds("a", 10.0)
    assert book.reserve("a", "10.0.0.1", 8.0) == Granted(18.0)
    assert book.holds("a", 17.0)
    book.expire(18.0)
    assert len(book) == 0


def test_one_source_cannot_take_every_slot_by_minting_ids():
    book = ReservationBook(RULES)
    assert isinstance(book.reserve("a", "10.0.0.1", 0.0), Granted)
    assert isinstance(book.reserve("b", "10.0.0.1", 0.0), Granted)
    refused = book.reserve("c", "10.0.0.1", 0.0)
    assert isinstance(refused, Refused) and "source" in refused.reason
    assert isinstance(book.reserve("d", "10.0.0.2", 0.0), Granted)  # others still get one
    # a refresh is not a new reservation
    assert isinstance(book.reserve("a", "10.0.0.1", 1.0), Granted)


def test_the_book_is_bounded_in_total():
    book = ReservationBook(RULES)
    for i in range(4):
        assert isinstance(book.reserve(f"p{i}", f"10.0.0.{i}", 0.0), Granted)
    assert book.reserve("late", "10.0.0.9", 1.0) == Refused("no reservation slots left")


def test_refreshing_forever_yields_the_slot_to_a_newcomer_when_full():
    book = ReservationBook(RULES)
    t = 0.0
    for i in range(4):
        book.reserve(f"p{i}", f"10.0.0.{i}", t)
    while t < 100.0:  # every holder refreshes in time, for max_hold_s
        t += 5.0
        for i in range(4):
            assert isinstance(book.reserve(f"p{i}", f"10.0.0.{i}", t), Granted)
    granted = book.reserve("new", "10.0.0.9", t)
    assert granted == Granted(t + 10.0, evicted="p0")
    assert not book.holds("p0", t) and book.holds("new", t)
    # the newcomer is young: the next one waits for another holder past max_hold_s
    assert isinstance(book.reserve("p0", "10.0.0.0", t), Granted)  # p1 was past it too
    assert not book.holds("p1", t)


def test_an_uncontended_holder_keeps_its_slot():
    book = ReservationBook(RULES)
    for t in range(0, 1000, 5):
        assert isinstance(book.reserve("a", "10.0.0.1", float(t)), Granted)
    assert book.holds("a", 999.0)


def test_rules_validate():
    with pytest.raises(ValueError):
        ReservationRules(max_total=0)
    with pytest.raises(ValueError):
        ReservationRules(ttl_s=0)


ops = st.lists(
    st.tuples(st.integers(0, 9), st.integers(0, 3), st.floats(0, 30)), max_size=80
)


@given(ops)
def test_bounds_hold_whatever_is_asked(steps):
    book = ReservationBook(RULES)
    now = 0.0
    for peer, source, dt in steps:
        now += dt
        result = book.reserve(f"p{peer}", f"s{source}", now)
        assert len(book) <= RULES.max_total
        per_source: dict[str, int] = {}
        for slot in book._slots.values():
            per_source[slot.source] = per_source.get(slot.source, 0) + 1
            assert slot.expiry > now and slot.expiry <= now + RULES.ttl_s
        assert max(per_source.values(), default=0) <= RULES.max_per_source
        if isinstance(result, Granted):
            assert book.holds(f"p{peer}", now)
            if result.evicted is not None:
                assert not book.holds(result.evicted, now)
