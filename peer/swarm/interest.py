"""Pure: the entry peer's side of the lookup beyond the ring (gossip mode `ring`).

A ring peer hears only its neighbours' summaries; for a prompt whose prefix root it does
not hold it looks the root up at the homes, asks a few holders how much they hold, and
keeps hearing those whose checked summary shows the root. `Interest` is that bounded set
of extra peers, `Lookups` the decisions around it. Both take `now` and a `random.Random`;
the live shell (peer/swarm/lookup.py) and the simulator drive them (docs/protocol.md 5.5).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from peer.swarm.neighbourhood import NeighbourhoodChange

__all__ = [
    "DEFAULT_INTEREST_PEERS",
    "DEFAULT_PROBES_PER_LOOKUP",
    "DEFAULT_PROVIDERS_PER_LOOKUP",
    "MAX_LOOKUP_MEMORY",
    "Interest",
    "Lookups",
]

DEFAULT_INTEREST_PEERS = 8  # extra peers heard: the ring's 8 plus 8 keeps receipts bounded
DEFAULT_PROVIDERS_PER_LOOKUP = 2  # two holders: one may be busy (two choices, Mitzenmacher)
# Holders asked how much of the prompt they hold (a small Match each) before the best
# two are asked for their summary: a root's holders differ in how much of its prompts
# they keep. Hit ratio in the simulator (`python -m bench.simulate --one --peers 256
# --requests 8192 --gossip-mode ring --lookup-probes P`): P = 2: 0.868, 4: 0.879,
# 8: 0.889, 16: 0.898 (full flooding: 0.918); messages per peer per second 10.9, 11.5,
# 12.4, 13.4 (full: 137). Each probe is a stream the holder answers.
DEFAULT_PROBES_PER_LOOKUP = 4
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
        probes_per_lookup: int = DEFAULT_PROBES_PER_LOOKUP,
    ) -> None:
        if providers_per_lookup < 1 or probes_per_lookup < providers_per_lookup:
            raise ValueError(
                "need providers_per_lookup >= 1 and probes_per_lookup >= it, got "
                f"{providers_per_lookup} and {probes_per_lookup}"
            )
        self.interest = interest
        self._rng = rng
        self._per_lookup = providers_per_lookup
        self._probes = probes_per_lookup

    def wanted(
        self, root: int, local_blocks: int, heard_blocks: int, chain_blocks: int, now: float
    ) -> bool:
        """Look `root` up now? Not when this peer holds it (`local_blocks`), nor when a
        peer it hears holds the whole prompt (`heard_blocks`, the best Bloom estimate, of
        `chain_blocks`), nor within the gap of the last lookup of the same root (then it
        is remembered as looked up). A heard peer holding only part of the prompt does
        not stop the lookup: another may hold more (measured in the simulator at 256
        peers: 34% of requests were routed below the longest match when it did)."""
        if local_blocks >= 1 or heard_blocks >= max(1, chain_blocks):
            return False
        return self.interest.should_lookup(root, now)

    def holders_to_probe(self, providers: Sequence[str], heard: Collection[str]) -> list[str]:
        """A random few of the providers named (duplicates and peers in `heard`, e.g.
        this one and its ring neighbours, skipped), to ask how much of the prompt they
        hold: always the most recent announcers would herd a root's requests onto them."""
        candidates = [p for p in dict.fromkeys(providers) if p not in heard]
        return self._rng.sample(candidates, min(len(candidates), self._probes))

    def holders_to_ask(self, matches: Mapping[str, int], heard_blocks: int) -> list[str]:
        """Of the probed holders' answers (peer id -> blocks held), the ones to ask for
        their summary: the longest matches, ties in random order, and only those longer
        than the best heard already (`heard_blocks`): the others add nothing."""
        better = [p for p, blocks in matches.items() if blocks > heard_blocks]
        self._rng.shuffle(better)
        better.sort(key=lambda p: -matches[p])
        return better[: self._per_lookup]

    def admit(
        self, asked: Iterable[str], holds_root: Callable[[str], bool], exclude: Iterable[str]
    ) -> NeighbourhoodChange:
        """Keep hearing the holders asked whose summary (checked and applied by the
        caller) shows the root; who joined and who left the Interest."""
        return self.interest.add([p for p in asked if holds_root(p)], exclude=exclude)

    def touch(self, peer_id: str) -> None:
        """A request was routed to `peer_id`."""
        self.interest.touch(peer_id)
