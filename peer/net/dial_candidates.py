"""Pure: the providers discovery may dial, bounded, expiring and dialled on a budget.

Provider records are hearsay: any connected peer answers GET_PROVIDERS with whatever it
likes, so a stranger can name a thousand identities at unreachable addresses. The book
therefore weighs where a candidate came from and what became of dialling it:

- a *proven* candidate (we were connected to it once) or one whose record it sent us
  itself (LOCAL_SOURCE: the DHT checked the sender) is kept and re-dialled with
  back-off; one we only heard of from others is dropped after UNPROVEN_DIAL_FAILURES
  failed dials and not taken back for UNREACHABLE_S;
- a candidate no one names again for CANDIDATE_TTL_S (and not connected) expires;
- one source may name at most MAX_NAMED_PER_SOURCE unproven candidates that no one else
  named (an honest reply holds at most k = 20 records, py-libp2p's provider store bound),
  less one for each candidate only it named that proved unreachable in the last
  UNREACHABLE_S: a source of fakes soon names nothing we dial;
- dials come from a token bucket (DIALS_PER_S, burst DIAL_BURST), proven candidates
  first, then those named by more sources, fewer failures, longest known.

`Discovery` (peer/net/discovery.py) feeds it and performs the dials; time is a parameter.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

__all__ = [
    "CANDIDATE_TTL_S",
    "DIALS_PER_S",
    "DIAL_BURST",
    "LOCAL_SOURCE",
    "MAX_CANDIDATES",
    "MAX_NAMED_PER_SOURCE",
    "UNPROVEN_DIAL_FAILURES",
    "UNREACHABLE_S",
    "CandidateBook",
    "Dial",
]

T = TypeVar("T")

MAX_CANDIDATES = 1024  # providers remembered; bounds memory against a flood of records
MAX_SOURCES_KEPT = 8  # sources remembered per candidate: more adds no ranking signal
MAX_NAMED_PER_SOURCE = 20  # k: what one honest GET_PROVIDERS reply can hold
CANDIDATE_TTL_S = 120.0  # records are re-learned every discovery round (<= 15 s) while
#   any source still names them; two minutes of silence means no one does
UNPROVEN_DIAL_FAILURES = 2  # a provider never reached gets two tries (one may be a blip)
UNREACHABLE_S = 600.0  # ...then is not taken back for 10 minutes, whoever names it again
MAX_UNREACHABLE = 4096  # unreachable ids remembered; beyond, the oldest is forgotten
MAX_BLAMED_SOURCES = 1024  # sources with blame remembered; beyond, the oldest is forgotten
DIAL_BACKOFF_FIRST_S = 1.0  # a candidate that failed once is retried after a second
DIAL_BACKOFF_MAX_S = 60.0  # ...and at most once a minute once it keeps failing
# Dials a peer starts: 16 at once (a swarm's providers found in one round), then 4 a
# second. A swarm of 100 peers is dialled within ~25 s; a flood of fakes costs <= 4/s.
DIAL_BURST = 16.0
DIALS_PER_S = 4.0
LOCAL_SOURCE = ""  # our own provider store: records whose provider announced itself to us


class Dial(NamedTuple, Generic[T]):
    """Dial this candidate now."""

    peer_id: str
    info: T


@dataclass
class _Candidate(Generic[T]):
    info: T
    learned: int  # order first heard of, for the ranking's last tie-break
    heard_at: float  # when a source last named it
    sources: list[str] = field(default_factory=list)
    proven: bool = False  # we were connected to it
    failures: int = 0  # consecutive failed dials
    next_attempt: float = 0.0


class CandidateBook(Generic[T]):
    """Candidates to dial: learned from sources, ranked, dialled within a budget."""

    def __init__(
        self,
        *,
        max_candidates: int = MAX_CANDIDATES,
        dials_per_s: float = DIALS_PER_S,
        dial_burst: float = DIAL_BURST,
        ttl_s: float = CANDIDATE_TTL_S,
    ) -> None:
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        if not (dials_per_s > 0 and dial_burst >= 1 and math.isfinite(dials_per_s + dial_burst)):
            raise ValueError("dials_per_s must be > 0 and dial_burst >= 1, both finite")
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be finite and > 0, got {ttl_s}")
        self._max = max_candidates
        self._rate = dials_per_s
        self._burst = dial_burst
        self._ttl_s = ttl_s
        self._tokens = dial_burst
        self._refilled_at: float | None = None
        self._candidates: dict[str, _Candidate[T]] = {}
        self._named: dict[str, int] = {}  # source -> unproven candidates only it named
        self._unreachable: OrderedDict[str, float] = OrderedDict()  # peer -> until when
        # source -> until when each unreachable candidate it alone named counts against it
        self._blame: OrderedDict[str, list[float]] = OrderedDict()
        self._learned = 0
        self._stats = {
            "learned": 0, "ignored_unreachable": 0, "ignored_source_cap": 0,
            "ignored_full": 0, "expired": 0, "dropped_unreachable": 0, "dials": 0,
            "dials_deferred": 0,
        }

    def __len__(self) -> int:
        return len(self._candidates)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._candidates

    def failures(self, peer_id: str) -> int:
        cand = self._candidates.get(peer_id)
        return cand.failures if cand is not None else 0

    # -- what sources say ---------------------------------------------------------------

    def _sole_source(self, cand: _Candidate[T]) -> str | None:
        if not cand.proven and len(cand.sources) == 1:
            return cand.sources[0]
        return None

    def _unname(self, cand: _Candidate[T]) -> None:
        source = self._sole_source(cand)
        if source is not None and source != LOCAL_SOURCE:
            left = self._named[source] - 1
            if left:
                self._named[source] = left
            else:
                del self._named[source]

    def _name(self, cand: _Candidate[T]) -> None:
        source = self._sole_source(cand)
        if source is not None and source != LOCAL_SOURCE:
            self._named[source] = self._named.get(source, 0) + 1

    def learn(
        self, peer_id: str, info: T, source: str, now: float, *, replace_info: bool = True
    ) -> bool:
        """`source` (a peer id, or LOCAL_SOURCE) names `peer_id` as a provider at `info`
        (which replaces what was known, unless not `replace_info`). False: ignored
        (unreachable lately, the source's share taken, or the book full of better
        candidates)."""
        _check_time(now)
        cand = self._candidates.get(peer_id)
        if cand is None:
            until = self._unreachable.get(peer_id)
            if until is not None and now < until:
                self._stats["ignored_unreachable"] += 1
                return False
            self._unreachable.pop(peer_id, None)
            if source != LOCAL_SOURCE and self._named.get(source, 0) >= self._share(source, now):
                self._stats["ignored_source_cap"] += 1
                return False
            if len(self._candidates) >= self._max and not self._make_room(now):
                self._stats["ignored_full"] += 1
                return False
            cand = _Candidate(info, self._learned, now, [source])
            self._learned += 1
            self._candidates[peer_id] = cand
            self._name(cand)
            self._stats["learned"] += 1
            return True
        if replace_info:
            cand.info = info
        cand.heard_at = now
        if source not in cand.sources and len(cand.sources) < MAX_SOURCES_KEPT:
            self._unname(cand)
            cand.sources.append(source)
            self._name(cand)
        return True

    def _share(self, source: str, now: float) -> int:
        """Unproven candidates `source` may have named alone, less its recent blame."""
        blame = self._blame.get(source)
        if blame is None:
            return MAX_NAMED_PER_SOURCE
        blame[:] = [until for until in blame if until > now]
        if not blame:
            del self._blame[source]
        return max(0, MAX_NAMED_PER_SOURCE - len(blame))

    def _blame_source(self, source: str, until: float) -> None:
        blame = self._blame.pop(source, [])
        blame.append(until)
        self._blame[source] = blame[-MAX_NAMED_PER_SOURCE:]  # more cannot lower the share
        while len(self._blame) > MAX_BLAMED_SOURCES:
            self._blame.popitem(last=False)

    def _make_room(self, now: float) -> bool:
        """Drop an expired candidate, else the unproven one ranked last."""
        self.expire(now, lambda peer: False)
        if len(self._candidates) < self._max:
            return True
        unproven = [(p, c) for p, c in self._candidates.items() if not c.proven]
        if not unproven:
            return False
        peer_id, _ = max(unproven, key=lambda pc: self._rank(pc[1]))
        self._drop(peer_id)
        return True

    def _drop(self, peer_id: str) -> None:
        self._unname(self._candidates.pop(peer_id))

    def expire(self, now: float, connected: Callable[[str], bool]) -> list[str]:
        """Drop candidates no source named for the TTL and not connected now."""
        _check_time(now)
        gone = [
            p for p, c in self._candidates.items()
            if now - c.heard_at >= self._ttl_s and not connected(p)
        ]
        for peer_id in gone:
            self._drop(peer_id)
        self._stats["expired"] += len(gone)
        return gone

    # -- dialling -----------------------------------------------------------------------

    def _rank(self, cand: _Candidate[T]) -> tuple[bool, int, int, int]:
        return (not cand.proven, -len(cand.sources), cand.failures, cand.learned)

    def _refill(self, now: float) -> None:
        if self._refilled_at is not None:
            elapsed = max(0.0, now - self._refilled_at)
            self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        self._refilled_at = now

    def due(self, now: float, connected: Callable[[str], bool]) -> list[Dial[T]]:
        """The candidates to dial now, best first, as many as the budget allows; each
        is charged a token. Connected ones are marked proven and not dialled."""
        _check_time(now)
        self.expire(now, connected)
        self._refill(now)
        waiting: list[tuple[tuple[bool, int, int, int], str]] = []
        for peer_id, cand in list(self._candidates.items()):
            if connected(peer_id):
                self.connected(peer_id)
            elif now >= cand.next_attempt:
                waiting.append((self._rank(cand), peer_id))
        waiting.sort()
        allowed = min(len(waiting), int(self._tokens))
        self._tokens -= allowed
        self._stats["dials"] += allowed
        self._stats["dials_deferred"] += len(waiting) - allowed
        return [Dial(p, self._candidates[p].info) for _, p in waiting[:allowed]]

    def connected(self, peer_id: str) -> None:
        """We are connected to `peer_id` (dialled, or it dialled us): proven, no failures."""
        cand = self._candidates.get(peer_id)
        if cand is None:
            return
        self._unname(cand)
        cand.proven = True
        cand.failures = 0
        cand.next_attempt = 0.0

    def dial_failed(self, peer_id: str, now: float) -> int:
        """A dial of `peer_id` failed: back off, or drop a candidate only heard of from
        others that failed UNPROVEN_DIAL_FAILURES times. Returns its consecutive
        failures."""
        _check_time(now)
        cand = self._candidates.get(peer_id)
        if cand is None:
            return 0
        cand.failures += 1
        hearsay = not cand.proven and LOCAL_SOURCE not in cand.sources
        if hearsay and cand.failures >= UNPROVEN_DIAL_FAILURES:
            source = self._sole_source(cand)
            if source is not None and source != LOCAL_SOURCE:
                self._blame_source(source, now + UNREACHABLE_S)
            self._drop(peer_id)
            self._unreachable.pop(peer_id, None)
            self._unreachable[peer_id] = now + UNREACHABLE_S
            while len(self._unreachable) > MAX_UNREACHABLE:
                self._unreachable.popitem(last=False)
            self._stats["dropped_unreachable"] += 1
            return cand.failures
        delay = min(DIAL_BACKOFF_MAX_S, DIAL_BACKOFF_FIRST_S * 2 ** (cand.failures - 1))
        cand.next_attempt = now + delay
        return cand.failures

    def statistics(self) -> dict[str, int]:
        return {
            **self._stats,
            "candidates": len(self._candidates),
            "unproven": sum(not c.proven for c in self._candidates.values()),
            "unreachable": len(self._unreachable),
        }


def _check_time(now: float) -> None:
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now}")
