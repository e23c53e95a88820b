"""Pure: the bounded set of peers whose summaries this peer hears (gossip mode `ring`).

Every peer id gets a position on a 64-bit ring (the first 8 bytes of its SHA-256). A
peer's neighbourhood is the `size // 2` peers that follow it on the ring and the
`size - size // 2` that precede it, among the peers it knows. With the same knowledge
the relation is symmetric (A is among B's neighbours iff B is among A's), so each peer
both hears and is heard by about `size` peers, whatever the swarm's size; nobody
chooses, nobody coordinates, and a peer cannot place itself next to a victim without
grinding keys (positions are hashes of public keys).

`update(known)` recomputes the set from the ids the shell knows (connected pubsub peers,
DHT providers) and reports who joined and left, for the shell to subscribe to or drop.
Why a ring and not sharding by prefix or deltas: docs/protocol.md, "Gossip modes".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import NamedTuple

__all__ = [
    "DEFAULT_NEIGHBOURS",
    "MAX_KNOWN_PEERS",
    "MAX_NEIGHBOURS",
    "Neighbourhood",
    "NeighbourhoodChange",
    "ring_position",
]

# 8 neighbours at one summary per 2 s: 4 messages/s received, ~2.4% of a core at py-libp2p's
# ~6 ms per message (docs/libp2p.md), and 8 caches besides its own for an entry peer to
# route to (the simulator's scale sweep: docs/results/f_scale.md).
DEFAULT_NEIGHBOURS = 8
MAX_NEIGHBOURS = 64  # a PeerTable holds 256 peers; a neighbourhood is a small part of it
MAX_KNOWN_PEERS = 65536  # ids considered per update: far beyond one model's swarm
_RING = 1 << 64


def ring_position(peer_id: str) -> int:
    """The peer's place on the ring: a hash of its id, so not chosen by the peer."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")


class NeighbourhoodChange(NamedTuple):
    """Who `update` added to and removed from the neighbourhood (sorted ids)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]


class Neighbourhood:
    """The `size` ring neighbours of `self_id` among the known peers."""

    def __init__(self, self_id: str, size: int = DEFAULT_NEIGHBOURS) -> None:
        if not self_id:
            raise ValueError("self_id must be this peer's id")
        if not 1 <= size <= MAX_NEIGHBOURS:
            raise ValueError(f"size must be in [1, {MAX_NEIGHBOURS}], got {size}")
        self._self_id = self_id
        self._self_pos = ring_position(self_id)
        self._size = size
        self._members: frozenset[str] = frozenset()
        self._positions: dict[str, int] = {}  # memo: ids seen are hashed once

    @property
    def size(self) -> int:
        return self._size

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._members

    def _position(self, peer_id: str) -> int:
        pos = self._positions.get(peer_id)
        if pos is None:
            if len(self._positions) >= MAX_KNOWN_PEERS:
                self._positions.clear()
            pos = self._positions[peer_id] = ring_position(peer_id)
        return pos

    def select(self, known: Iterable[str]) -> frozenset[str]:
        """The neighbourhood among `known` (self and duplicates ignored), not applied."""
        ids: set[str] = set()
        for peer_id in known:
            if peer_id != self._self_id:
                ids.add(peer_id)
                if len(ids) >= MAX_KNOWN_PEERS:
                    break
        if len(ids) <= self._size:
            return frozenset(ids)
        me = self._self_pos
        # clockwise distance from us (successors) and to us (predecessors)
        after = sorted(ids, key=lambda p: ((self._position(p) - me) % _RING, p))
        n_after = self._size // 2
        chosen = set(after[:n_after])
        for peer_id in reversed(after):
            if len(chosen) >= self._size:
                break
            chosen.add(peer_id)
        return frozenset(chosen)

    def update(self, known: Iterable[str]) -> NeighbourhoodChange:
        """Recompute from the ids known now; who joined and who left."""
        new = self.select(known)
        old = self._members
        self._members = new
        return NeighbourhoodChange(tuple(sorted(new - old)), tuple(sorted(old - new)))
