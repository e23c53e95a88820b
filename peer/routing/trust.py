"""The trust ledger: what each remote peer claimed, what it delivered, and what follows (pure).

Fed by method calls (time and randomness are parameters), it decides and returns actions
(`Promote`, `Quarantine`) that the pipeline carries out: new identities are on probation
(they serve no client; copies of requests served anyway check them: peer/routing/shadow.py)
until ``probation_requests`` answers matched, their first answers to clients once trusted
are audited (re-scored after delivery: `should_audit`), trusted peers' answers are
verified before delivery at `verify_fraction`, a failed check quarantines for good,
overshooting Bloom claims discount a peer's claims, observed speeds bound advertised
ones (peer/routing/claims.py), and every lapse
that cost a client time (a failure, a stall, a hedge race lost, a decode far slower than
claimed) is charged to a reliability debt that ranks the peer after the entry peer while
it lasts (peer/routing/reliability.py). docs/security.md says what each rule stops.
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from peer.routing.reliability import CHARGES, Debt, Lapse, credit, decayed, underdelivery_charge
from peer.routing.reliability import charge as charge_debt

__all__ = [
    "AUDITS_WAITING",
    "DEFAULT_PROBATION_REQUESTS",
    "DEFAULT_VERIFY_FRACTION",
    "ClaimsState",
    "PeerTrust",
    "Promote",
    "Quarantine",
    "QuarantineRecord",
    "RoutingTrust",
    "TrustLedger",
    "TrustState",
    "dump_quarantine",
    "parse_quarantine",
]

# Defaults and bounds, each with its reason.
AUDITS_WAITING = 4  # delivered answers waiting for their audit (peer/request/evidence.py);
#   beyond it an audit is dropped
DEFAULT_VERIFY_FRACTION = 0.1  # an always-lying trusted peer is caught within 50 forwards
#   with probability 1 - 0.9**50 = 99.5% (the target is >= 95%, which needs f >= 0.06)
DEFAULT_PROBATION_REQUESTS = 3  # matching shadow answers before a new identity is trusted:
#   each costs it a whole generation, and an honest peer earns trust within a few requests
OVERSHOOT_ALLOWANCE = 0.1  # honest overshoots per claim: the Bloom false-positive rate
#   (1% by default) plus summaries gone stale by evictions since they were sent
EXCESS_GRACE = 2.0  # unexplained overshoots tolerated before any discount
DISCOUNT_PER_EXCESS = 0.5  # the claim factor halves per unexplained overshoot past the grace
IGNORE_BELOW = 0.1  # a factor under this: the peer's claims are ignored (factor 0)
SPEED_WINDOW = 8  # observations of a peer's speeds kept (the best of them bounds its claims:
#   a forward timed while the peer was busier than its estimate reads slow)
MAX_TRACKED_PEERS = 4096  # non-quarantined peers remembered; far above MAX_PEERS (256)
MAX_QUARANTINED = 65_536  # quarantine records kept (a Sybil flood cannot grow it further)
MAX_REASON_CHARS = 300  # a reason is a sentence for the operator, not a transcript
MAX_PEER_ID_CHARS = 128  # base58 ed25519 ids are ~52 characters


class TrustState(enum.StrEnum):
    PROBATION = "probation"
    TRUSTED = "trusted"
    QUARANTINED = "quarantined"


class ClaimsState(enum.StrEnum):
    BELIEVED = "believed"
    DISCOUNTED = "discounted"
    IGNORED = "ignored"


class Quarantine(NamedTuple):
    """Action: never route to ``peer_id`` again; persist the record."""

    peer_id: str
    reason: str
    at: float


class Promote(NamedTuple):
    """Action (for the log): ``peer_id`` passed probation."""

    peer_id: str
    verified: int


class QuarantineRecord(NamedTuple):
    peer_id: str
    reason: str
    at: float  # the shell's clock when quarantined (wall time when persisted)


class RoutingTrust(NamedTuple):
    """What a routing decision reads about one peer (`TrustLedger.routing`)."""

    probation: bool
    factor: float  # claim_factor
    observed_prefill: float  # the best observed; 0: never (claims count up to ours)
    observed_decode: float
    demoted_until: float = -math.inf  # its reliability debt ranks it after self until then
    lapsed_at: float = 0.0  # when it was last charged (the shell's clock)


class PeerTrust(NamedTuple):
    """A snapshot of the ledger's view of one peer (for /v1/swarm and logs)."""

    state: TrustState
    reason: str
    verified: int  # verified good responses (shadow answers that matched included)
    served: int  # responses delivered to clients (verified or not)
    discount: float  # the factor the router multiplies claimed matches by
    claims: ClaimsState
    claims_checked: int
    overshoots: int
    observed_prefill_tokens_per_s: float  # 0 until observed
    observed_decode_tokens_per_s: float
    debt: float = 0.0  # reliability debt, in failures, when last charged or credited
    lapses: int = 0  # lapses charged (failures, stalls, hedges lost, underdelivery)


@dataclass
class _Peer:
    verified: int = 0
    served: int = 0
    audited: int = 0  # answers to clients re-scored after delivery (should_audit)
    trusted: bool = False
    claims_checked: int = 0
    overshoots: int = 0
    excess: float = 0.0
    prefill: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_WINDOW))
    decode: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_WINDOW))
    debt: Debt = field(default_factory=Debt)
    lapses: int = 0
    routing: RoutingTrust | None = None  # kept current for the router (None: recompute)


def _check_fraction(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value}")


class TrustLedger:
    """Per-peer trust, claims and observed speeds; returns Quarantine / Promote actions."""

    def __init__(
        self,
        *,
        verify_fraction: float = DEFAULT_VERIFY_FRACTION,
        probation_requests: int = DEFAULT_PROBATION_REQUESTS,
        can_verify: bool = True,
        quarantined: Iterable[QuarantineRecord] = (),
    ) -> None:
        _check_fraction("verify_fraction", verify_fraction)
        if probation_requests < 0:
            raise ValueError(f"probation_requests must be >= 0, got {probation_requests}")
        self.verify_fraction = verify_fraction
        self.probation_requests = probation_requests
        self.can_verify = can_verify
        self._peers: dict[str, _Peer] = {}
        self._quarantined: dict[str, QuarantineRecord] = {}
        self._unknown = RoutingTrust(probation_requests > 0, 1.0, 0.0, 0.0)
        self._counts: dict[str, int] = {}
        for record in quarantined:
            self._keep_quarantine(record)

    # -- queries the router asks ----------------------------------------------------------

    def routable(self, peer_id: str) -> bool:
        return peer_id not in self._quarantined

    def on_probation(self, peer_id: str) -> bool:
        if peer_id in self._quarantined or self.probation_requests == 0:
            return False
        peer = self._peers.get(peer_id)
        return peer is None or not peer.trusted

    def claim_factor(self, peer_id: str) -> float:
        """What the router multiplies the peer's claimed (Bloom) match by: 1, less, or 0."""
        peer = self._peers.get(peer_id)
        if peer is None:
            return 1.0
        return _factor(peer.excess)

    def routing(self, peer_id: str) -> RoutingTrust | None:
        """Everything the router needs about ``peer_id`` at once; None if quarantined."""
        if peer_id in self._quarantined:
            return None
        peer = self._peers.get(peer_id)
        if peer is None:
            return self._unknown
        if peer.routing is None:
            peer.routing = RoutingTrust(
                not peer.trusted and self.probation_requests > 0,
                _factor(peer.excess),
                max(peer.prefill, default=0.0),
                max(peer.decode, default=0.0),
                peer.debt.demoted_until,
                peer.debt.at,
            )
        return peer.routing

    def should_verify(self, peer_id: str, rng: random.Random) -> bool:
        """Whether to verify this response of ``peer_id`` before delivering any of it."""
        if not self.can_verify:
            return False
        if self.on_probation(peer_id):
            return True
        return rng.random() < self.verify_probability(peer_id)

    def verify_probability(self, peer_id: str) -> float:
        """How likely a trusted peer's next response is verified before delivery:
        ``verify_fraction``. (Holding an answer back until it is re-scored costs its
        client the whole answer's time to first token, so the first answers after
        promotion are audited instead: `should_audit`.)"""
        del peer_id
        return self.verify_fraction

    def should_audit(self, peer_id: str) -> bool:
        """Whether a response of ``peer_id`` delivered unverified is re-scored after
        delivery: probation goes on into service. Its first ``probation_requests``
        answers to clients after promotion are audited, since passing probation proves
        only answers the peer may have obtained elsewhere (proxied to an honest peer). A
        launderer that lies once trusted delivers one lie, is quarantined by the audit,
        and its signed answer is evidence for every other peer. A fraction of 0 (verify no
        trusted peer) turns this off too."""
        if not self.can_verify or self.verify_fraction == 0.0:
            return False
        peer = self._peers.get(peer_id)
        if peer is None or not peer.trusted or peer_id in self._quarantined:
            return False
        return peer.audited < self.probation_requests

    def record_audit(self, peer_id: str) -> None:
        """An answer of ``peer_id`` was handed to an audit (`should_audit`)."""
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.audited += 1
            self._count("audited")

    # -- what happened -----------------------------------------------------------------------

    def record_claim(self, peer_id: str, claimed_tokens: int, cached_tokens: int) -> ClaimsState:
        """A forward whose summary claimed ``claimed_tokens`` cached came back with
        ``cached_tokens`` reported: an overshoot if it got fewer than claimed."""
        if claimed_tokens < 0 or cached_tokens < 0:
            raise ValueError("token counts must be >= 0")
        peer = self._peer(peer_id)
        peer.routing = None
        if claimed_tokens > 0:
            peer.claims_checked += 1
            if cached_tokens < claimed_tokens:
                peer.overshoots += 1
                peer.excess += 1.0
                self._count("claims_overshot")
            peer.excess = max(0.0, peer.excess - OVERSHOOT_ALLOWANCE)
        return _claims_state(peer.excess)

    def record_speeds(
        self, peer_id: str, prefill_tokens_per_s: float | None, decode_tokens_per_s: float | None
    ) -> None:
        """Speeds measured here of a forward to ``peer_id`` (None: not measurable)."""
        peer = self._peer(peer_id)
        peer.routing = None
        for value, window in ((prefill_tokens_per_s, peer.prefill), (decode_tokens_per_s,
                                                                       peer.decode)):
            if value is not None and math.isfinite(value) and value > 0:
                window.append(value)

    def record_lapse(
        self, peer_id: str, lapse: Lapse, now: float, amount: float | None = None
    ) -> float:
        """``peer_id`` cost a client time (reliability.py): charge its debt ``amount``, by
        default the lapse's. Returns what was charged (0 for a quarantined peer)."""
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        if peer_id in self._quarantined:
            return 0.0
        if amount is None:
            amount = CHARGES[lapse]
        peer = self._peer(peer_id)
        peer.debt = charge_debt(peer.debt, amount, now)
        peer.lapses += 1
        peer.routing = None
        self._count(f"charged_{lapse.value}")
        return amount

    def record_delivery(
        self, peer_id: str, claimed_decode: float, observed_decode: float | None, now: float
    ) -> float:
        """A forward to ``peer_id`` decoded at ``observed_decode`` (None: not measurable)
        after its summary claimed ``claimed_decode`` (claims.claimed_decode): charged when
        it delivered far less than it claimed. Returns the charge."""
        if observed_decode is None:
            return 0.0
        amount = underdelivery_charge(claimed_decode, observed_decode)
        if amount <= 0.0:
            return 0.0
        return self.record_lapse(peer_id, Lapse.UNDERDELIVERED, now, amount)

    def record_served(
        self, peer_id: str, *, verified: bool, now: float | None = None
    ) -> Promote | None:
        """A response of ``peer_id`` was delivered, verified good or unverified; at
        ``now`` (the shell's clock) it repays part of the peer's reliability debt."""
        if peer_id in self._quarantined:
            return None
        peer = self._peer(peer_id)
        peer.served += 1
        if now is not None and peer.debt.amount > 0.0:
            peer.debt = credit(peer.debt, now)
            peer.routing = None
        if not verified:
            return None
        peer.verified += 1
        self._count("verified_ok")
        return self._promote(peer_id, peer)

    def record_shadow_match(self, peer_id: str) -> Promote | None:
        """A shadow answer of ``peer_id`` (peer/routing/shadow.py) equals the answer this
        peer delivered: a verified answer that reached no client."""
        if peer_id in self._quarantined:
            return None
        peer = self._peer(peer_id)
        peer.verified += 1
        self._count("shadow_matched")
        return self._promote(peer_id, peer)

    def _promote(self, peer_id: str, peer: _Peer) -> Promote | None:
        if not peer.trusted and peer.verified >= self.probation_requests:
            peer.trusted = True
            peer.routing = None
            self._count("promoted")
            return Promote(peer_id, peer.verified)
        return None

    def quarantine(self, peer_id: str, reason: str, now: float) -> Quarantine | None:
        """Quarantine ``peer_id`` for ``reason``; None if it already is."""
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        if peer_id in self._quarantined:
            return None
        record = QuarantineRecord(peer_id, reason[:MAX_REASON_CHARS], now)
        self._keep_quarantine(record)
        self._peers.pop(peer_id, None)
        self._count("quarantined")
        return Quarantine(*record)

    def _keep_quarantine(self, record: QuarantineRecord) -> None:
        self._quarantined[record.peer_id] = record
        while len(self._quarantined) > MAX_QUARANTINED:
            del self._quarantined[next(iter(self._quarantined))]

    def _peer(self, peer_id: str) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = _Peer()
            while len(self._peers) > MAX_TRACKED_PEERS:
                del self._peers[next(iter(self._peers))]
        return peer

    def _count(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    # -- views ------------------------------------------------------------------------------

    def view(self, peer_id: str) -> PeerTrust:
        record = self._quarantined.get(peer_id)
        peer = self._peers.get(peer_id) or _Peer()
        if record is not None:
            state, reason = TrustState.QUARANTINED, record.reason
        elif self.on_probation(peer_id):
            state, reason = TrustState.PROBATION, "new identity"
        else:
            state, reason = TrustState.TRUSTED, ""
        return PeerTrust(
            state,
            reason,
            peer.verified,
            peer.served,
            0.0 if record else _factor(peer.excess),
            _claims_state(peer.excess),
            peer.claims_checked,
            peer.overshoots,
            max(peer.prefill, default=0.0),
            max(peer.decode, default=0.0),
            peer.debt.amount,
            peer.lapses,
        )

    def debt(self, peer_id: str, now: float) -> float:
        """``peer_id``'s reliability debt at ``now``, in failures."""
        peer = self._peers.get(peer_id)
        return 0.0 if peer is None else decayed(peer.debt, now)

    def quarantine_records(self) -> list[QuarantineRecord]:
        return list(self._quarantined.values())

    def statistics(self) -> dict[str, int]:
        stats = dict(sorted(self._counts.items()))
        stats["peers_tracked"] = len(self._peers)
        stats["peers_quarantined"] = len(self._quarantined)
        stats["peers_trusted"] = sum(p.trusted for p in self._peers.values())
        return stats


def _factor(excess: float) -> float:
    if excess <= EXCESS_GRACE:
        return 1.0
    factor: float = DISCOUNT_PER_EXCESS ** (excess - EXCESS_GRACE)
    return factor if factor >= IGNORE_BELOW else 0.0


def _claims_state(excess: float) -> ClaimsState:
    factor = _factor(excess)
    if factor >= 1.0:
        return ClaimsState.BELIEVED
    return ClaimsState.DISCOUNTED if factor > 0 else ClaimsState.IGNORED


# -- persistence format (the shell reads and writes the file) -------------------------------


def dump_quarantine(records: Iterable[QuarantineRecord]) -> str:
    """The quarantine file's JSON text."""
    return json.dumps(
        {"version": 1, "quarantined": [r._asdict() for r in records]}, indent=1, sort_keys=True
    )


def parse_quarantine(text: str) -> list[QuarantineRecord]:
    """Records from a quarantine file's text; ValueError naming what is wrong."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(obj, Mapping) or obj.get("version") != 1:
        raise ValueError("expected an object with version 1")
    items = obj.get("quarantined")
    if not isinstance(items, list) or len(items) > MAX_QUARANTINED:
        raise ValueError(f"quarantined must be a list of at most {MAX_QUARANTINED} records")
    records = []
    for item in items:
        if not isinstance(item, Mapping):
            raise ValueError(f"a record must be an object, got {item!r:.80}")
        peer_id, reason, at = item.get("peer_id"), item.get("reason"), item.get("at")
        if not (isinstance(peer_id, str) and 0 < len(peer_id) <= MAX_PEER_ID_CHARS):
            raise ValueError(f"bad peer_id in {item!r:.120}")
        if not isinstance(reason, str) or not isinstance(at, int | float) or isinstance(at, bool):
            raise ValueError(f"bad reason or time in {item!r:.120}")
        if not math.isfinite(at):
            raise ValueError(f"bad time in {item!r:.120}")
        records.append(QuarantineRecord(peer_id, reason[:MAX_REASON_CHARS], float(at)))
    return records
