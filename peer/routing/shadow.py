"""Shadow verification: how a peer on probation earns trust without serving a client (pure).

A new identity never serves this peer's clients. While it is on probation, requests that
this peer serves anyway (locally or through trusted peers) are also sent, as ordinary
forwards, to the probation peer the router ranks best; its answer is compared with the
answer the client received. `DEFAULT_PROBATION_REQUESTS` matching answers make it trusted
(the ledger's `record_shadow_match`), one that differs (and that the entry's verifier,
where it has one, rejects) quarantines it; a difference the verifier accepts (a near-tie
on other hardware) earns nothing and costs nothing. The newcomer pays for
its own trust with real compute (or real proxy bandwidth); this peer computes nothing
extra, and a cold swarm routes as soon as the shadows have matched.

Only answers that must be identical are compared (`comparable`): greedy ones, and sampled
ones, which the entry always seeds. The work is
bounded: at most one shadow per request, one in flight per probation peer, and
``max_in_flight`` at once. The planner decides; the request path (peer/request/shadow.py)
sends, reads, compares and reports back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from peer.routing.cost import Candidate
from peer.routing.trust import Promote, Quarantine, TrustLedger

__all__ = [
    "DEFAULT_MAX_SHADOWS_IN_FLIGHT",
    "DEFAULT_SHADOW_SHARE",
    "Shadow",
    "ShadowPlanner",
    "comparable",
    "first_difference",
]

DEFAULT_SHADOW_SHARE = 1  # every request may carry one shadow: a cold swarm earns trust in
#   a few requests (the in-flight bounds, not the share, bound the extra traffic)
DEFAULT_MAX_SHADOWS_IN_FLIGHT = 4  # shadows of one entry at once: a flood of new identities
#   costs the entry at most four extra streams (its own compute is never spent on them),
#   and a swarm of five earns each newcomer's trust in parallel


class Shadow(NamedTuple):
    """Decision: send a copy of this request to ``peer_id`` (on probation) and compare."""

    peer_id: str
    number: int  # this planner's count, to tell shadows apart


def comparable(temperature: float, seed: int | None = None) -> bool:
    """Whether two honest answers to a request must be identical: greedy decoding, or
    sampling with a seed (every peer draws with the same keyed sampler,
    peer/engine/sampling.py)."""
    return temperature == 0.0 or seed is not None


def first_difference(delivered: Sequence[int], shadow: Sequence[int]) -> int | None:
    """The first index where the two answers differ (a length counts), None if equal."""
    for i, (a, b) in enumerate(zip(delivered, shadow, strict=False)):
        if a != b:
            return i
    if len(delivered) != len(shadow):
        return min(len(delivered), len(shadow))
    return None


class ShadowPlanner:
    """Chooses shadows for requests and turns their verdicts into trust actions."""

    def __init__(
        self,
        ledger: TrustLedger,
        *,
        share: int = DEFAULT_SHADOW_SHARE,
        max_in_flight: int = DEFAULT_MAX_SHADOWS_IN_FLIGHT,
    ) -> None:
        if share < 1:
            raise ValueError(f"share must be >= 1, got {share}")
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.ledger = ledger
        self.share = share
        self.max_in_flight = max_in_flight
        self._in_flight: dict[str, Shadow] = {}  # by probation peer: one each
        self._since_turn = share  # the first request with a probation peer may carry one
        self._number = 0
        self._counts: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def busy(self, peer_id: str) -> bool:
        """Whether a shadow to ``peer_id`` is in flight."""
        return peer_id in self._in_flight

    def choose(
        self, probation: Sequence[Candidate], *, temperature: float, private: bool,
        seed: int | None = None,
    ) -> Shadow | None:
        """A shadow for this request, or None: ``probation`` is the router's probation
        peers for it, best first (`Router.rank_all`). A private request never leaves this
        peer; an answer that need not be identical cannot be compared; a peer that failed
        recently, or already has a shadow in flight, is skipped; one request in ``share``
        (among those with a probation peer) may carry one, ``max_in_flight`` at once."""
        if not probation or private:
            return None
        if not comparable(temperature, seed):
            self._count("skipped_not_comparable")
            return None
        ready = [
            c for c in probation
            if c.estimate.failed_s_ago is None and c.peer_id not in self._in_flight
            and self.ledger.on_probation(c.peer_id)
        ]  # fmt: skip
        if not ready:
            self._count("skipped_busy")
            return None
        if len(self._in_flight) >= self.max_in_flight:
            self._count("skipped_at_limit")
            return None
        if self._since_turn + 1 < self.share:
            self._since_turn += 1
            self._count("skipped_share")
            return None
        self._since_turn = 0
        self._number += 1
        shadow = Shadow(ready[0].peer_id, self._number)
        self._in_flight[shadow.peer_id] = shadow
        self._count("sent")
        return shadow

    def matched(self, shadow: Shadow) -> Promote | None:
        """The shadow's answer equals the one delivered: one more verified answer."""
        self._end(shadow)
        self._count("matched")
        return self.ledger.record_shadow_match(shadow.peer_id)

    def mismatched(self, shadow: Shadow, detail: str, now: float) -> Quarantine | None:
        """The shadow's answer differs (and did not verify): quarantine, as a lie."""
        self._end(shadow)
        self._count("mismatched")
        return self.ledger.quarantine(shadow.peer_id, f"shadow answer differs: {detail}", now)

    def inconclusive(self, shadow: Shadow) -> None:
        """The answers differ but the verifier accepts the shadow's (a near-tie on other
        hardware, or a wrong delivered answer): no credit, no quarantine."""
        self._end(shadow)
        self._count("inconclusive")

    def obtained_elsewhere(self, shadow: Shadow) -> None:
        """The answers are equal, but a peer says the probation peer asked it for the
        prompt (protocols/served.py): no credit, no quarantine (a claim, not a proof);
        the caller backs the peer off as after a failed shadow."""
        self._end(shadow)
        self._count("obtained_elsewhere")

    def ended(self, shadow: Shadow, *, failed: bool) -> None:
        """No verdict: the shadow failed (the caller backs the peer off), or the client's
        request ended without an answer to compare with (``failed`` False)."""
        self._end(shadow)
        self._count("failed" if failed else "abandoned")

    def _end(self, shadow: Shadow) -> None:
        if self._in_flight.get(shadow.peer_id) != shadow:
            raise ValueError(f"{shadow} is not in flight")
        del self._in_flight[shadow.peer_id]

    def _count(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def statistics(self) -> dict[str, int]:
        stats = {f"shadow_{k}": v for k, v in sorted(self._counts.items())}
        stats["shadows_in_flight"] = len(self._in_flight)
        return stats
