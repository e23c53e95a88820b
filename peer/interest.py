"""Pure: on-demand knowledge beyond the ring (gossip mode `ring`): who holds a prefix root.

A ring peer hears its neighbours' summaries only. When it is asked for a prompt whose
first block (the prefix root) no peer it hears holds, it looks the root up and then
listens to a few of the holders too, as long as it keeps being asked for what they hold:

- `ProviderIndex`: provider records per prefix root, as the root's home peers keep them
  (the peers nearest the root's ring position; a holder announces a root when it caches
  it and withdraws it on eviction; records also expire). Bounded per root and in total.
- `Interest`: the entry peer's bounded, least-recently-used set of such extra peers, and
  a per-root gap between lookups so a root nobody holds is not looked up on every request.

Both take `now`; neither does I/O. The simulator drives them (bench/sim/model.py); the
live shell does not yet (docs/protocol.md, "Gossip modes").
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from peer.neighbourhood import NeighbourhoodChange

__all__ = [
    "DEFAULT_INTEREST_PEERS",
    "DEFAULT_PROVIDERS_PER_LOOKUP",
    "MAX_PROVIDERS_PER_ROOT",
    "MAX_ROOTS",
    "Interest",
    "ProviderIndex",
]

DEFAULT_INTEREST_PEERS = 8  # extra peers heard: the ring's 8 plus 8 keeps receipts bounded
DEFAULT_PROVIDERS_PER_LOOKUP = 2  # two holders: one may be busy (two choices, Mitzenmacher)
MAX_PROVIDERS_PER_ROOT = 16  # the most recent announcers; more only adds choice, not hits
MAX_ROOTS = 65536  # roots indexed per home peer; ~1 MB of records at 16 providers each
MAX_LOOKUP_MEMORY = 4096  # roots whose last lookup time an entry remembers


class ProviderIndex:
    """Provider records: prefix root -> the peers that announced holding it, newest last."""

    def __init__(self, ttl_s: float, max_per_root: int = MAX_PROVIDERS_PER_ROOT) -> None:
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be finite and > 0, got {ttl_s}")
        if max_per_root < 1:
            raise ValueError(f"max_per_root must be >= 1, got {max_per_root}")
        self._ttl_s = ttl_s
        self._max_per_root = max_per_root
        # root -> peer id -> when announced (insertion order: oldest first)
        self._records: OrderedDict[int, OrderedDict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def announce(self, root: int, peer_id: str, now: float) -> None:
        """`peer_id` holds `root` as of `now` (a newer announcement refreshes it)."""
        records = self._records.get(root)
        if records is None:
            if len(self._records) >= MAX_ROOTS:
                self._records.popitem(last=False)  # the root least recently announced
            records = self._records[root] = OrderedDict()
        else:
            self._records.move_to_end(root)
        records.pop(peer_id, None)
        records[peer_id] = now
        while len(records) > self._max_per_root:
            records.popitem(last=False)

    def withdraw(self, root: int, peer_id: str) -> None:
        """`peer_id` no longer holds `root`."""
        records = self._records.get(root)
        if records is not None:
            records.pop(peer_id, None)
            if not records:
                del self._records[root]

    def providers(self, root: int, now: float) -> list[str]:
        """The live records for `root`, most recently announced first."""
        records = self._records.get(root)
        if records is None:
            return []
        return [p for p, t in reversed(records.items()) if now - t < self._ttl_s]


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
