"""Which evidence of a lie to check, and whom to tell (pure; time is a parameter).

Checking evidence (protocols/answers.py) costs a signature check and then a re-scoring
of the answer on this peer's model, about one prefill. `EvidenceDesk` decides, for each
piece that arrives, whether it is worth that: never about this peer itself or a peer
already quarantined, never the same answer twice, at most `max_checking` at once, and at
most one check per sender per `sender_interval_s`, so a peer that sends evidence which
does not hold up (it cannot forge any: the accused's own signature is needed) wastes at
most one re-scoring per interval here. `spread_targets` names the peers to pass a
confirmed lie on to: each peer tells its own table once, so it reaches every peer that
some peer knows, and a quarantine ends the spreading (already quarantined: skipped).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Iterable

__all__ = ["Consider", "EvidenceDesk", "spread_targets"]

DEFAULT_MAX_CHECKING = 1  # re-scorings at once: each is about one prefill of the prompt
DEFAULT_SENDER_INTERVAL_S = 5.0  # one check per sender per interval
MAX_SEEN = 1024  # answer digests remembered as checked
MAX_SENDERS = 1024  # senders remembered for their interval
MAX_SPREAD = 32  # peers told of one confirmed lie by this peer


class Consider(enum.StrEnum):
    """What to do with a piece of evidence (CHECK, or why not)."""

    CHECK = "check"
    ABOUT_US = "about_us"
    ALREADY_QUARANTINED = "already_quarantined"
    SEEN = "seen"
    BUSY = "busy"
    SENDER_TOO_FREQUENT = "sender_too_frequent"


class EvidenceDesk:
    """Bounded, deduplicated admission of evidence to be checked."""

    def __init__(
        self, *, self_id: str, max_checking: int = DEFAULT_MAX_CHECKING,
        sender_interval_s: float = DEFAULT_SENDER_INTERVAL_S,
    ) -> None:
        if max_checking < 1 or not (math.isfinite(sender_interval_s) and sender_interval_s >= 0):
            raise ValueError("max_checking must be >= 1 and sender_interval_s >= 0")
        self.self_id = self_id
        self.max_checking = max_checking
        self.sender_interval_s = sender_interval_s
        self.checking = 0
        self._seen: deque[bytes] = deque(maxlen=MAX_SEEN)
        self._seen_set: set[bytes] = set()
        self._last_check: OrderedDict[str, float] = OrderedDict()
        self.counts: dict[str, int] = {}

    def consider(
        self, sender: str, accused: str, digest: bytes, now: float, *, quarantined: bool
    ) -> Consider:
        """Whether to check evidence from `sender` against `accused` whose signed answer
        hashes to `digest`; CHECK reserves a check (call `done` when it ends)."""
        verdict = self._consider(sender, accused, digest, now, quarantined)
        self.counts[verdict.value] = self.counts.get(verdict.value, 0) + 1
        if verdict is Consider.CHECK:
            self.checking += 1
            if len(self._seen) == self._seen.maxlen:
                self._seen_set.discard(self._seen[0])
            self._seen.append(digest)
            self._seen_set.add(digest)
            self._last_check[sender] = now
            self._last_check.move_to_end(sender)
            while len(self._last_check) > MAX_SENDERS:
                self._last_check.popitem(last=False)
        return verdict

    def _consider(
        self, sender: str, accused: str, digest: bytes, now: float, quarantined: bool
    ) -> Consider:
        if accused == self.self_id:
            return Consider.ABOUT_US
        if quarantined:
            return Consider.ALREADY_QUARANTINED
        if digest in self._seen_set:
            return Consider.SEEN
        if self.checking >= self.max_checking:
            return Consider.BUSY
        last = self._last_check.get(sender)
        if last is not None and now - last < self.sender_interval_s:
            return Consider.SENDER_TOO_FREQUENT
        return Consider.CHECK

    def done(self) -> None:
        """A check reserved by `consider` ended (whatever its verdict)."""
        self.checking = max(0, self.checking - 1)


def spread_targets(
    peers: Iterable[str], *, accused: str, self_id: str, source: str | None,
    limit: int = MAX_SPREAD,
) -> list[str]:
    """The peers to tell of a confirmed lie: known peers other than the accused, this
    peer and the one that told us, at most `limit`, in the order given."""
    skip = {accused, self_id} | ({source} if source else set())
    out: list[str] = []
    for peer in peers:
        if peer not in skip and peer not in out:
            out.append(peer)
            if len(out) >= limit:
                break
    return out
