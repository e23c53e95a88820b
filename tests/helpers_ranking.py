"""Assertions about rankings, shared by the ranking-core and router tests."""

from __future__ import annotations

from collections.abc import Sequence

from peer.routing.cost import Candidate, tie_limit_s


def assert_cost_order(candidates: Sequence[Candidate]) -> None:
    """COST's order: cheapest first, except that a near tie goes to the longest match. The
    first is within the tie margin of the cheapest and matches the most among those; the
    rest are in cost order."""
    cheapest = min(candidates, key=lambda c: c.cost_s)
    tied = [c for c in candidates if c.cost_s <= tie_limit_s(cheapest)]
    assert candidates[0] in tied
    assert candidates[0].match_blocks == max(c.match_blocks for c in tied)
    rest = [c.cost_s for c in candidates[1:]]
    assert rest == sorted(rest)
