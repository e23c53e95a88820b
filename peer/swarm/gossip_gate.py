"""Pure: which received summaries are worth checking, decided before their signature is.

Checking a summary costs this peer CPU (py-libp2p's signature check, then decode,
PeerTable.apply and relaying it on), and keys are free: a stranger can sign summaries for
as many fresh identities as it likes and send them as fast as gossip lets it. So the
origin is looked at first, for the price of a dictionary lookup:

- an origin this peer was connected to (proven in the table, or connected now): CHECK;
- an unproven origin that the table holds no entry for and has no room for (its
  unproven share or the whole table is full of live entries): NO_ROOM, dropped unchecked
  and remembered as seen, so that gossip neither relays it nor fetches it again;
- any other unproven origin: CHECK within two budgets, one per forwarder
  (UNPROVEN_PER_FORWARDER_PER_S after a burst) and one in all (UNPROVEN_PER_S), else
  OVER_BUDGET (not marked seen: it may come again from another forwarder, or later).
  What this peer relays of unproven origins is therefore bounded by UNPROVEN_PER_S.
- a forwarder whose messages keep being refused (NO_ROOM or OVER_BUDGET beyond
  REFUSALS_PER_S after a burst of REFUSALS_BURST) is GRAYLIST-ed for GRAYLIST_S: the
  shell stops reading its gossip. An honest forwarder cannot get there: it relays
  unproven origins within its own UNPROVEN_PER_S, below REFUSALS_PER_S.

A new honest peer is hardly held back: its first summaries arrive one per interval, and
once connected it is checked like any known peer (go-libp2p's gossipsub graylists peers
by score in the same spirit).
"""

from __future__ import annotations

import enum

from peer.net.keyed_budget import KeyedBudget

__all__ = [
    "GRAYLIST_S",
    "REFUSALS_BURST",
    "REFUSALS_PER_S",
    "UNPROVEN_PER_FORWARDER_BURST",
    "UNPROVEN_PER_FORWARDER_PER_S",
    "UNPROVEN_PER_S",
    "GateVerdict",
    "GossipGate",
]

UNPROVEN_PER_FORWARDER_PER_S = 4.0  # unproven origins' summaries checked per forwarder...
UNPROVEN_PER_FORWARDER_BURST = 32  # ...after this many at once (a swarm that starts together)
UNPROVEN_PER_S = 16.0  # ...and from all forwarders together
UNPROVEN_BURST = 64
REFUSALS_PER_S = 32.0  # refused messages a forwarder may send, after...
REFUSALS_BURST = 256
GRAYLIST_S = 600.0
MAX_FORWARDERS = 1024  # forwarders tracked (least recently used dropped, come back empty)
_ALL = ""  # the key of the budget shared by all forwarders


class GateVerdict(enum.StrEnum):
    CHECK = "check"
    NO_ROOM = "no_room"
    OVER_BUDGET = "over_budget"
    GRAYLIST = "graylist"  # refused, and the forwarder is graylisted from now on


class GossipGate:
    """Decides a verdict for each received summary; counts each; remembers graylists."""

    def __init__(
        self,
        *,
        per_forwarder_s: float = UNPROVEN_PER_FORWARDER_PER_S,
        per_forwarder_burst: int = UNPROVEN_PER_FORWARDER_BURST,
        total_s: float = UNPROVEN_PER_S,
        total_burst: int = UNPROVEN_BURST,
        refusals_s: float = REFUSALS_PER_S,
        refusals_burst: int = REFUSALS_BURST,
        graylist_s: float = GRAYLIST_S,
        max_forwarders: int = MAX_FORWARDERS,
    ) -> None:
        if not (per_forwarder_s > 0 and total_s > 0 and refusals_s > 0 and graylist_s > 0):
            raise ValueError("rates and graylist_s must be > 0")
        self._forwarders = KeyedBudget(
            burst=per_forwarder_burst, refill_s=1.0 / per_forwarder_s, max_keys=max_forwarders
        )
        self._total = KeyedBudget(burst=total_burst, refill_s=1.0 / total_s, max_keys=1)
        self._refusals = KeyedBudget(
            burst=refusals_burst, refill_s=1.0 / refusals_s, max_keys=max_forwarders
        )
        self._graylist_s = graylist_s
        self._graylisted: dict[str, float] = {}  # forwarder -> until when
        self.counts: dict[GateVerdict, int] = dict.fromkeys(GateVerdict, 0)

    def decide(
        self, forwarder: str, *, proven: bool, held: bool, room: bool, now: float
    ) -> GateVerdict:
        """`proven`: this peer was (or is) connected to the origin; `held`: the table has an
        entry for it; `room`: the table would admit a new unproven peer now
        (PeerTable.room_for_unproven)."""
        if proven:
            verdict = GateVerdict.CHECK
        elif not held and not room:
            verdict = GateVerdict.NO_ROOM
        elif self._forwarders.try_take(forwarder, now) and self._total.try_take(_ALL, now):
            verdict = GateVerdict.CHECK
        else:
            verdict = GateVerdict.OVER_BUDGET
        if verdict is not GateVerdict.CHECK and not self._refusals.try_take(forwarder, now):
            verdict = GateVerdict.GRAYLIST
            self._graylisted[forwarder] = now + self._graylist_s
        self.counts[verdict] += 1
        return verdict

    def graylist_ended(self, now: float) -> list[str]:
        """Forwarders whose graylisting is over (forgotten here; the shell lets them in)."""
        ended = sorted(f for f, until in self._graylisted.items() if until <= now)
        for forwarder in ended:
            del self._graylisted[forwarder]
        return ended

    @property
    def graylisted(self) -> int:
        return len(self._graylisted)
