"""Rank -> probe -> rerank, decided: what an entry peer does with its ranked candidates.

`next_step` is called with the router's ranking and no reports first: it answers
`ProbeFirst` (ask these peers for their load now, peer/routing/probing.py chose whom and
for how long) or `RaceThese` (the candidates to try, best first). After a probe it is
called again with the reports that arrived, and answers `RaceThese` with the candidates
ranked again on their fresh load (one that did not answer keeps its gossiped load). The
live pipeline and the simulator both run this sequence; each does its own waiting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from peer.routing.probing import ProbeRound, ProbeSettings, plan_probes
from peer.routing.router import Candidate, Router
from peer.swarm.peer_table import PeerTable
from protocols.load import LoadReport

__all__ = ["ProbeFirst", "RaceThese", "next_step"]


@dataclass(frozen=True)
class ProbeFirst:
    """Ask ``round.plan.peers`` for their load (until ``round.deadline`` or
    ``round.done``), then call `next_step` again with ``round.reports``."""

    round: ProbeRound


@dataclass(frozen=True)
class RaceThese:
    """The candidates to try, best first; ``changed``: a probe changed the first choice."""

    candidates: list[Candidate]
    changed: bool = False


def next_step(
    ranked: Sequence[Candidate],
    reports: Mapping[str, LoadReport] | None,
    now: float,
    *,
    router: Router,
    table: PeerTable,
    settings: ProbeSettings,
    not_after: float = math.inf,
    private: bool = False,
) -> ProbeFirst | RaceThese:
    """What to do next with ``ranked`` (the router's rank()): ``reports`` None before any
    probe, else what the probe brought (possibly nothing). A ``private`` request (it has
    a cache salt) stays on this peer: only the local candidate, never a probe.
    ``not_after``: a probe round ends by then (the request's deadline)."""
    if private:
        return RaceThese([c for c in ranked if c.is_local])
    if reports is None:
        plan = plan_probes(ranked, settings, router.probe_waits.late_s)
        if not plan.probes:
            router.probe_waits.not_probed()  # routed without a probe: the figure ages
            return RaceThese(list(ranked))
        return ProbeFirst(ProbeRound(plan, now, not_after=not_after))
    if not reports:
        return RaceThese(list(ranked))
    again = router.rerank(ranked, reports, table, now)
    changed = bool(again) and bool(ranked) and again[0].peer_id != ranked[0].peer_id
    return RaceThese(again, changed)
