"""Relay reservations, the pure part: who may hold one of a relay's slots, and how long.

A relay gives slots to private peers so others can reach them. Identities are free, so
the slots are bounded by what is not: network sources (a requester's IP address) and
time. Rules, each a bound:
- one reservation per peer id (a refresh replaces it), `max_total` in all;
- at most `max_per_source` ids from one source, so one machine cannot take every slot
  by minting identities;
- a reservation lapses `ttl_s` after its last refresh;
- refreshes keep a reservation only up to `max_hold_s` while others are waiting: when
  the book is full, a newcomer takes the slot of the longest holder past `max_hold_s`
  (an honest private peer then reserves elsewhere; an uncontended relay keeps it).
Whether a requester is eligible at all (connected, not quarantined) is the shell's
check (peer/net/relay_server.py). No I/O and no clock: time is a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Granted", "Refused", "ReservationBook", "ReservationRules"]


@dataclass(frozen=True)
class ReservationRules:
    """What a relay gives away in reservations."""

    max_total: int = 64  # peers that may be reached through us
    max_per_source: int = 4  # ...of which from one network source (IP address)
    ttl_s: float = 300.0  # a reservation lapses unless refreshed
    max_hold_s: float = 3600.0  # past this a holder yields its slot to a newcomer when full

    def __post_init__(self) -> None:
        for name in ("max_total", "max_per_source"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ttl_s", "max_hold_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Granted:
    """A reservation granted or refreshed until `expiry`; `evicted` lost its slot to it."""

    expiry: float
    evicted: str | None = None


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass
class _Slot:
    source: str
    since: float  # first granted (refreshes keep it)
    expiry: float


@dataclass
class ReservationBook:
    """The reservations a relay holds for others."""

    rules: ReservationRules = field(default_factory=ReservationRules)
    _slots: dict[str, _Slot] = field(default_factory=dict)

    def reserve(self, peer_id: str, source: str, now: float) -> Granted | Refused:
        """Grant, refresh or refuse `peer_id`'s reservation, asked from `source`."""
        self.expire(now)
        expiry = now + self.rules.ttl_s
        slot = self._slots.get(peer_id)
        if slot is not None and slot.source == source:
            slot.expiry = expiry
            return Granted(expiry)
        if slot is not None:  # the same id from elsewhere: a new reservation, counted anew
            del self._slots[peer_id]
        if self._from(source) >= self.rules.max_per_source:
            return Refused(f"{self.rules.max_per_source} reservations from that source already")
        evicted = None
        if len(self._slots) >= self.rules.max_total:
            evicted = self._longest_past_hold(now)
            if evicted is None:
                return Refused("no reservation slots left")
            del self._slots[evicted]
        self._slots[peer_id] = _Slot(source, now, expiry)
        return Granted(expiry, evicted)

    def holds(self, peer_id: str, now: float) -> bool:
        slot = self._slots.get(peer_id)
        return slot is not None and now < slot.expiry

    def expire(self, now: float) -> None:
        for peer_id in [p for p, s in self._slots.items() if now >= s.expiry]:
            del self._slots[peer_id]

    def __len__(self) -> int:
        return len(self._slots)

    def _from(self, source: str) -> int:
        return sum(s.source == source for s in self._slots.values())

    def _longest_past_hold(self, now: float) -> str | None:
        past = [(s.since, p) for p, s in self._slots.items()
                if now - s.since >= self.rules.max_hold_s]
        return min(past)[1] if past else None
