"""Pure: when a peer publishes its cache summary, and the shape of its Bloom filter.

One copy of the decision, driven by the live shell (peer/swarm/gossip.py: `observe` the radix
cache's events, `poll(trio.current_time())`, sleep until `next_deadline()`) and by the
simulator (bench/sim/model.py, the same calls at simulated times), so the two cannot
drift apart (tests/test_publish_policy.py checks both against this class).

The rule: publish every `interval_s`, and early (at most once per
`interval_s * EARLY_GAP_FRACTION`) once CHANGE_FRACTION of the cached blocks changed
since the last summary. The filter is sized by `peer.swarm.bloom_sizing.summary_bloom` for the
number of blocks cached at publish time (a power of two, at least MIN_BLOOM_CAPACITY).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from peer.engine.radix import EventKind
from peer.swarm.bloom_sizing import summary_bloom

__all__ = [
    "CHANGE_FRACTION",
    "EARLY_GAP_FRACTION",
    "Publish",
    "PublishPolicy",
    "bloom_shape",
]

CHANGE_FRACTION = 0.05  # publish early once 5% of the cached blocks changed
EARLY_GAP_FRACTION = 0.25  # ...but at most once per quarter interval (pubsub allows 10/s)
_EPS = 1e-9  # float round-off in times that a simulator adds up


class _EventLike(Protocol):
    @property
    def kind(self) -> EventKind: ...


class Publish(NamedTuple):
    """What `poll` decided: publish now; `early` when triggered by change, not the timer."""

    early: bool
    changed_blocks: int  # cache changes counted since the previous summary


def bloom_shape(cached_blocks: int, fp_rate: float) -> tuple[int, int]:
    """(num_bits, num_hashes) of the filter a peer with `cached_blocks` publishes."""
    bloom = summary_bloom(cached_blocks, fp_rate)
    return bloom.num_bits, bloom.num_hashes


class PublishPolicy:
    """Decides when to publish; fed cache events and the cache's size, polled with `now`."""

    def __init__(
        self,
        interval_s: float,
        *,
        early_publish: bool = True,
        change_fraction: float = CHANGE_FRACTION,
        early_gap_fraction: float = EARLY_GAP_FRACTION,
    ) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be finite and > 0, got {interval_s}")
        if not 0 < change_fraction <= 1:
            raise ValueError(f"change_fraction must be in (0, 1], got {change_fraction}")
        if not 0 < early_gap_fraction <= 1:
            raise ValueError(f"early_gap_fraction must be in (0, 1], got {early_gap_fraction}")
        self._interval_s = float(interval_s)
        self._early_gap_s = interval_s * early_gap_fraction
        self._early_publish = early_publish
        self._change_fraction = change_fraction
        self._last = -math.inf  # when the last summary was published
        self._polled = -math.inf  # when poll last ran
        self._changed = 0
        self._cached_blocks = 0

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def last_publish(self) -> float:
        return self._last

    @property
    def changed_blocks(self) -> int:
        return self._changed

    def observe(self, events: Iterable[_EventLike], cached_blocks: int) -> None:
        """Count STORED/REMOVED cache events; `cached_blocks` is the cache's size now."""
        if cached_blocks < 0:
            raise ValueError(f"cached_blocks must be >= 0, got {cached_blocks}")
        for ev in events:
            if ev.kind is EventKind.STORED or ev.kind is EventKind.REMOVED:
                self._changed += 1
        self._cached_blocks = cached_blocks

    def poll(self, now: float) -> Publish | None:
        """Publish now? A `Publish` also records `now` as the publish time."""
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        self._polled = now
        since = now - self._last
        threshold = max(1, math.ceil(self._change_fraction * self._cached_blocks))
        due = since >= self._interval_s - _EPS
        early = (
            not due
            and self._early_publish
            and self._changed >= threshold
            and since >= self._early_gap_s - _EPS
        )
        if not (due or early):
            return None
        decision = Publish(early=early, changed_blocks=self._changed)
        self._last = now
        self._changed = 0
        return decision

    def next_deadline(self) -> float:
        """When to poll next: the periodic summary, or the next chance of an early one."""
        if self._last == -math.inf and self._polled == -math.inf:
            return -math.inf  # never polled: now
        return min(self._last + self._interval_s, self._polled + self._early_gap_s)
