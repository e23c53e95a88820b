"""What a peer's gossip published and received, per sender: the testbed's evidence of
summaries that never arrived.

A receiver counts, per sender, the summaries it applied (`accepted`), those that arrived
after a newer one and so were not applied (`late`: delivered, out of order), and the
newest seq it applied (`last_seq`); a publisher gives the seq of its first and last
publish (publishes number seqs one by one; `publish_failures` among them). A summary
newer than a receiver's `last_seq` may still be on its way; one older that never
arrived was lost. Pure (the caller says which senders are still live) and bounded: at
most `limit` senders, those no longer live forgotten first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class DeliveryCounts:
    """Counts of one peer's gossip, published and received per sender."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.first_seq: int | None = None
        self.seq: int | None = None
        self._accepted: dict[str, int] = {}
        self._late: dict[str, int] = {}
        self._last_seq: dict[str, int] = {}

    def published(self, seq: int) -> None:
        """We numbered a publish `seq` (whether or not it went out)."""
        if self.first_seq is None:
            self.first_seq = seq
        self.seq = seq

    def accepted(self, sender: str, seq: int, live: Callable[[str], bool]) -> None:
        """`sender`'s summary `seq` was applied."""
        if self._room(self._accepted, sender, live):
            self._accepted[sender] = self._accepted.get(sender, 0) + 1
            self._last_seq[sender] = seq

    def late(self, sender: str, live: Callable[[str], bool]) -> None:
        """A summary of `sender` arrived after a newer one (not a duplicate)."""
        if self._room(self._late, sender, live):
            self._late[sender] = self._late.get(sender, 0) + 1

    def _room(self, counts: dict[str, int], sender: str, live: Callable[[str], bool]) -> bool:
        if sender not in counts and len(counts) >= self._limit:
            for gone in [p for p in counts if not live(p)]:
                del counts[gone]
                if counts is self._accepted:
                    self._last_seq.pop(gone, None)
        return sender in counts or len(counts) < self._limit

    def snapshot(self, published: int, publish_failures: int) -> dict[str, Any]:
        """The counts as /v1/swarm's `gossip_counts` reports them."""
        return {
            "published": published,
            "publish_failures": publish_failures,
            "first_seq": self.first_seq,
            "seq": self.seq,
            "accepted": dict(self._accepted),
            "late": dict(self._late),
            "last_seq": dict(self._last_seq),
        }
