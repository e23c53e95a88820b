"""Pure: the entry peer's side of the lookup beyond the ring (gossip mode `ring`).

A ring peer hears its neighbours' summaries only. When it is asked for a prompt whose
first block (the prefix root) neither it nor any peer it hears holds, it looks the root
up at the root's home peers (peer/providers.py keeps the records there), asks a few of
the holders named for their summary, and keeps listening to those whose summary shows
the root, as long as it keeps being asked for what they hold:

- `Interest`: the bounded, least-recently-useful set of such extra peers, and a per-root
  gap between lookups so a root nobody holds is not looked up on every request.
- `Lookups`: the decisions around it: whether to look a root up now, which holders to
  ask (a random few, not already heard), which of them to keep hearing (only those
  whose checked summary holds the root: a provider record is a claim).

Both take `now` and a `random.Random`; neither does I/O. The live shell (peer/lookup.py)
and the simulator (bench/sim/model.py) drive the same objects (docs/protocol.md 5.4).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

from peer.neighbourhood import NeighbourhoodChange

__all__ = [
    "DEFAULT_INTEREST_PEERS",
    "DEFAULT_PROVIDERS_PER_LOOKUP",
    "MAX_LOOKUP_MEMORY",
    "Interest",
    "Lookups",
]

DEFAULT_INTEREST_PEERS = 8  # extra peers heard: the ring's 8 plus 8 keeps receipts bounded
DEFAULT_PROVIDERS_PER_LOOKUP = 2  # two holders: one may be busy (two choices, Mitzenmacher)
MAX_LOOKUP_MEMORY = 4096  # roots whose last lookup time an entry remembers


class Interest:
    """The extra peers an entry peer hears beyond its ring, least recently useful first out."""

    def __init__(self, size: int = DEFAULT_INTEREST_PEERS, lookup_gap_s: float = 2.0) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if not (math.isfinite(lookup_gap_s) and lookup_gap_s >= 0):
            raise ValueError(f"lookup_gap_s must be finite and >= 0, got {lookup_gap_s}")
        self._size = size
        self._gap = lookup_gap_s
        self._members: OrderedDict[str, None] = OrderedDict()
        self._looked_up: OrderedDict[int, float] = OrderedDict()

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._members

    def should_lookup(self, root: int, now: float) -> bool:
        """True (and remembered) unless `root` was looked up less than the gap ago."""
        if not self._size:
            return False
        last = self._looked_up.get(root)
        if last is not None and now - last < self._gap:
            return False
        self._looked_up.pop(root, None)
        self._looked_up[root] = now
        while len(self._looked_up) > MAX_LOOKUP_MEMORY:
            self._looked_up.popitem(last=False)
        return True

    def touch(self, peer_id: str) -> None:
        """`peer_id` was useful (a request went there): keep it longest."""
        if peer_id in self._members:
            self._members.move_to_end(peer_id)

    def add(self, peer_ids: Iterable[str], exclude: Iterable[str] = ()) -> NeighbourhoodChange:
        """Hear these peers too (those in `exclude`, e.g. ring neighbours, are skipped);
        the least recently useful members leave when over the size."""
        skip = set(exclude)
        added = []
        for peer_id in peer_ids:
            if peer_id in skip:
                continue
            if peer_id in self._members:
                self._members.move_to_end(peer_id)
            else:
                self._members[peer_id] = None
                added.append(peer_id)
        removed = []
        while len(self._members) > self._size:
            peer_id, _ = self._members.popitem(last=False)
            removed.append(peer_id)
        dropped_new = set(added) & set(removed)
        return NeighbourhoodChange(
            tuple(sorted(p for p in added if p not in dropped_new)),
            tuple(sorted(p for p in removed if p not in dropped_new)),
        )

    def remove(self, peer_id: str) -> None:
        self._members.pop(peer_id, None)


class Lookups:
    """The entry peer's lookup decisions, around its `Interest`."""

    def __init__(
        self,
        interest: Interest,
        rng: random.Random,
        providers_per_lookup: int = DEFAULT_PROVIDERS_PER_LOOKUP,
    ) -> None:
        if providers_per_lookup < 1:
            raise ValueError(f"providers_per_lookup must be >= 1, got {providers_per_lookup}")
        self.interest = interest
        self._rng = rng
        self._per_lookup = providers_per_lookup

    def wanted(self, root: int, local_blocks: int, heard_blocks: int, now: float) -> bool:
        """Look `root` up now? Not when this peer (`local_blocks`) or a peer it hears
        (`heard_blocks`, the best Bloom estimate) holds it, nor within the gap of the
        last lookup of the same root (then it is remembered as looked up)."""
        if local_blocks >= 1 or heard_blocks >= 1:
            return False
        return self.interest.should_lookup(root, now)

    def holders_to_ask(self, providers: Sequence[str], heard: Collection[str]) -> list[str]:
        """A random few of the providers named (duplicates and peers in `heard`, e.g.
        this one and its ring neighbours, skipped): the most recent announcers for every
        entry would herd a swarm's requests for a root onto the same two peers."""
        candidates = [p for p in dict.fromkeys(providers) if p not in heard]
        return self._rng.sample(candidates, min(len(candidates), self._per_lookup))

    def admit(
        self, asked: Iterable[str], holds_root: Callable[[str], bool], exclude: Iterable[str]
    ) -> NeighbourhoodChange:
        """Keep hearing the holders asked whose summary (checked and applied by the
        caller) shows the root; who joined and who left the Interest."""
        return self.interest.add([p for p in asked if holds_root(p)], exclude=exclude)

    def touch(self, peer_id: str) -> None:
        """A request was routed to `peer_id`."""
        self.interest.touch(peer_id)
