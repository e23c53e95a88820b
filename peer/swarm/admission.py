"""Pure: who gets a slot in a full peer table, proven peers before unproven ones.

A summary is signed by its origin, but keys are free: anyone can sign and keep fresh
the summaries of identities that never connect. So a table entry is *unproven* until the
peer shows it is reachable (the shell saw a connection to it, or a round trip was
measured), and unproven entries are held to a share of the table: they fill at most
`max_unproven` slots, and a proven newcomer takes the slot of the stalest unproven
entry when the table is full. A peer that proves itself therefore always gets a slot
unless the table holds `max_peers` proven peers. `decide` answers; PeerTable acts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["UNPROVEN_SHARE", "Admission", "Decision", "decide"]

# A quarter of the table: room for every peer whose first summary outran its connection
# (a swarm's joins arrive a few at a time), never enough to crowd out proven ones.
UNPROVEN_SHARE = 0.25


class Admission(enum.Enum):
    """What to do with a summary from a peer the table does not hold."""

    ADMIT = "admit"
    ADMIT_EVICTING = "admit_evicting"  # after dropping `Decision.victim`
    TABLE_FULL = "table_full"  # max_peers proven peers (or no unproven one to replace)
    UNPROVEN_FULL = "unproven_full"  # the unproven share is taken


class Decision(NamedTuple):
    action: Admission
    victim: str | None = None


def decide(
    *,
    proven: bool,
    size: int,
    max_peers: int,
    unproven: Mapping[str, float],
    max_unproven: int,
) -> Decision:
    """Admit a newcomer to a table of `size` live entries, `unproven` of them (peer id ->
    when its last summary arrived)?

    A proven newcomer gets a free slot, else the slot of the unproven entry heard from
    least recently; an unproven one gets a free slot only while fewer than
    `max_unproven` entries are unproven. Ties among victims go to the lower id."""
    if not 0 <= max_unproven <= max_peers or max_peers < 1:
        raise ValueError(f"need 0 <= max_unproven ({max_unproven}) <= max_peers ({max_peers})")
    if len(unproven) > size:
        raise ValueError(f"{len(unproven)} unproven entries in a table of {size}")
    if not proven:
        if len(unproven) >= max_unproven:
            return Decision(Admission.UNPROVEN_FULL)
        if size >= max_peers:
            return Decision(Admission.TABLE_FULL)
        return Decision(Admission.ADMIT)
    if size < max_peers:
        return Decision(Admission.ADMIT)
    if not unproven:
        return Decision(Admission.TABLE_FULL)
    victim = min(unproven, key=lambda peer: (unproven[peer], peer))
    return Decision(Admission.ADMIT_EVICTING, victim)
