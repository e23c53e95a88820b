"""bench.gossip's delivery accounting: the fraction of (summary, receiver) pairs delivered
and the receiver/sender pairs that missed summaries, from the runners' event lines."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bench.gossip import _propagation


def _proc(peer_id: str, events: list[dict[str, Any]]) -> Any:
    return SimpleNamespace(peer_id=peer_id, events=events)


def test_delivered_fraction_and_the_pairs_that_missed_summaries() -> None:
    a_seqs = (1, 2, 3, 4)
    a = _proc("a", [{"event": "published", "seq": s, "t": 10.0 + s} for s in a_seqs])
    a.events.append({"event": "published", "seq": 9, "t": 99.0})  # after the window
    b = _proc("b", [{"event": "accepted", "sender": "a", "seq": s, "t": 10.5 + s} for s in a_seqs])
    c = _proc("c", [{"event": "accepted", "sender": "a", "seq": 1, "t": 14.0}])  # 3 s late
    c.events.append({"event": "accepted", "sender": "a", "seq": 9, "t": 99.1})  # not counted
    prop = _propagation([a, b, c], 10.0, 20.0, {"a": {"b", "c"}, "b": set(), "c": set()})
    assert prop["summaries"] == 4
    assert prop["delivered_fraction"] == pytest.approx(5 / 8)
    assert prop["max_s"] == pytest.approx(3.0)
    assert prop["pairs_missing"] == 1
    assert prop["worst_pairs"] == [{"receiver": "c", "sender": "a", "missed": 3, "published": 4}]
