"""Pure: a token bucket per key (a peer id), with a bounded number of keys.

Used wherever a remote peer may make this one spend work on its behalf: punches served
per relay (peer/net/punch_policy.py), summaries of new identities checked per gossip
forwarder (peer/swarm/gossip_gate.py). No clock: time is a parameter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["KeyedBudget"]


@dataclass
class _Bucket:
    tokens: float
    at: float


class KeyedBudget:
    """A token bucket of `burst` per key, refilled one token per `refill_s`. At most
    `max_keys` keys are tracked; the least recently used is dropped first, and a dropped
    key comes back with a bucket that is empty, not full, so that cycling through keys
    never refills anyone's budget early."""

    def __init__(self, *, burst: int, refill_s: float, max_keys: int) -> None:
        if burst < 1 or max_keys < 1 or not refill_s > 0:
            raise ValueError("burst and max_keys must be >= 1 and refill_s > 0")
        self._burst = burst
        self._refill_s = refill_s
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._evicted = False  # once keys were dropped, unknown keys start empty

    def try_take(self, key: str, now: float) -> bool:
        """Spend one token of `key`'s budget if it has one; False when spent."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(0.0 if self._evicted else float(self._burst), now)
            self._buckets[key] = bucket
            while len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
                self._evicted = True
        self._buckets.move_to_end(key)
        elapsed = max(0.0, now - bucket.at)
        bucket.tokens = min(float(self._burst), bucket.tokens + elapsed / self._refill_s)
        bucket.at = max(bucket.at, now)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def __len__(self) -> int:
        return len(self._buckets)
