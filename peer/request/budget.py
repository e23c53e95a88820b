"""What serving other peers may cost this one: a budget per identity and one for all (pure).

A forwarded request costs the engine time this peer's own clients could have had. Its
cost is estimated when it arrives, in engine-seconds from the engine's measured speeds
(`request_cost_s`), and charged to two token buckets: the requesting identity's, which
refills at `identity_share` engine-seconds per second, and one shared by all remote
identities, which refills at `remote_share`. A stranger who asks for more than its share
is refused (`OverBudget`, with when to come back); a swarm of fresh identities shares the
remote bucket, so identities cost the attacker something but not this peer's clients.
`remote_slots` bounds how many remote requests may run in the engine at once, so some of
its batch always stays free for local requests. An idle engine serves anyone (charged all
the same): the budgets share contention, they do not waste idle time.

Time is a parameter (`now`, seconds on any monotonic clock); nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from peer.config import DEFAULT_IDENTITY_SHARE, DEFAULT_REMOTE_SHARE

__all__ = [
    "DEFAULT_IDENTITY_SHARE",
    "DEFAULT_REMOTE_SHARE",
    "Admitted",
    "BudgetPolicy",
    "OverBudget",
    "RemoteBudget",
    "request_cost_s",
]

DEFAULT_BURST_S = 30.0  # seconds of refill a full bucket holds: an honest burst of forwards
#   passes whole, sustained use is held to the share
DEFAULT_REMOTE_SLOTS = 8  # remote requests running at once (DEFAULT_MAX_RUNNING is 32)
MAX_IDENTITIES = 4096  # identities remembered; the least recently seen is forgotten
MIN_COST_S = 1e-4  # a request is never free, even when the engine's speeds are unknown
UNMEASURED_PREFILL_TPS = 1_000.0  # speeds assumed before the engine measured its own
UNMEASURED_DECODE_TPS = 20.0


def request_cost_s(
    prompt_tokens: int, max_new_tokens: int, prefill_tokens_per_s: float,
    decode_tokens_per_s: float,
) -> float:
    """Engine-seconds a request may take: its prompt at the prefill speed plus its longest
    answer at one stream's decode speed (speeds <= 0: not measured yet, assumed)."""
    if prompt_tokens < 0 or max_new_tokens < 0:
        raise ValueError("token counts must be >= 0")
    prefill = prefill_tokens_per_s if prefill_tokens_per_s > 0 else UNMEASURED_PREFILL_TPS
    decode = decode_tokens_per_s if decode_tokens_per_s > 0 else UNMEASURED_DECODE_TPS
    return max(MIN_COST_S, prompt_tokens / prefill + max_new_tokens / decode)


@dataclass(frozen=True)
class BudgetPolicy:
    """Shares are fractions of one engine's time; burst_s is how many seconds of refill a
    full bucket holds."""

    identity_share: float = DEFAULT_IDENTITY_SHARE
    remote_share: float = DEFAULT_REMOTE_SHARE
    burst_s: float = DEFAULT_BURST_S
    remote_slots: int = DEFAULT_REMOTE_SLOTS

    def __post_init__(self) -> None:
        for name in ("identity_share", "remote_share"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError(f"burst_s must be > 0, got {self.burst_s}")
        if self.remote_slots < 1:
            raise ValueError(f"remote_slots must be >= 1, got {self.remote_slots}")


class Admitted(NamedTuple):
    """The request may run; `release` it (RemoteBudget.release) when it ends."""

    peer_id: str
    cost_s: float


class OverBudget(NamedTuple):
    """Refused: ``reason`` says which budget; retry after ``retry_after_s``."""

    reason: str
    retry_after_s: float


class _Bucket:
    """A token bucket of engine-seconds: `level` at time `at`, refilling at `rate`, up to
    `capacity`. Charges may take it below zero (a request longer than a full bucket still
    runs once, and its debt is paid back before the next)."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait_for(self, cost: float) -> float:
        """Seconds until a charge of ``cost`` is allowed (0: now). A charge is allowed
        when the bucket holds it, or when it is full (costs above capacity)."""
        need = min(cost, self.capacity) - self.level
        return max(0.0, need / self.rate)


class RemoteBudget:
    """Per-identity and total token buckets plus a bound on remote requests running."""

    def __init__(self, policy: BudgetPolicy | None = None) -> None:
        self.policy = policy or BudgetPolicy()
        self._identities: OrderedDict[str, _Bucket] = OrderedDict()
        self._total: _Bucket | None = None
        self.running = 0
        self.admitted = 0
        self.admitted_idle = 0
        self.refused_identity = 0
        self.refused_total = 0
        self.refused_slots = 0

    def _total_bucket(self, now: float) -> _Bucket:
        if self._total is None:
            p = self.policy
            self._total = _Bucket(p.remote_share, p.remote_share * p.burst_s, now)
        self._total.refill(now)
        return self._total

    def _identity_bucket(self, peer_id: str, now: float) -> _Bucket:
        bucket = self._identities.get(peer_id)
        if bucket is None:
            p = self.policy
            bucket = _Bucket(p.identity_share, p.identity_share * p.burst_s, now)
            self._identities[peer_id] = bucket
            while len(self._identities) > MAX_IDENTITIES:
                self._identities.popitem(last=False)
        else:
            self._identities.move_to_end(peer_id)
        bucket.refill(now)
        return bucket

    def admit(
        self, peer_id: str, cost_s: float, now: float, *, idle: bool = False
    ) -> Admitted | OverBudget:
        """Charge ``cost_s`` engine-seconds to ``peer_id`` and to the remote total, or say
        why not (charging nothing). ``idle``: the engine runs nothing now, so the request
        takes time from nobody; it runs whatever the buckets hold, and is charged (a
        bucket's debt is bounded by its capacity). Budgets share contention, not idle
        time."""
        if not (math.isfinite(cost_s) and cost_s > 0) or not math.isfinite(now):
            raise ValueError(f"cost_s must be > 0 and now finite, got {cost_s}, {now}")
        if self.running >= self.policy.remote_slots:
            self.refused_slots += 1
            return OverBudget(
                f"at most {self.policy.remote_slots} remote requests run here at once",
                retry_after_s=min(cost_s, self.policy.burst_s),
            )
        mine = self._identity_bucket(peer_id, now)
        total = self._total_bucket(now)
        if not idle:
            wait = mine.wait_for(cost_s)
            if wait > 0:
                self.refused_identity += 1
                return OverBudget("this identity's share of the engine is spent", wait)
            wait = total.wait_for(cost_s)
            if wait > 0:
                self.refused_total += 1
                return OverBudget("the share of the engine for remote peers is spent", wait)
        for bucket in (mine, total):
            bucket.level = max(-bucket.capacity, bucket.level - cost_s)
        self.running += 1
        self.admitted += 1
        self.admitted_idle += idle
        return Admitted(peer_id, cost_s)

    def release(self, admitted: Admitted) -> None:
        """The admitted request ended (its cost stays charged)."""
        del admitted
        self.running = max(0, self.running - 1)

    def statistics(self) -> dict[str, int]:
        return {
            "remote_running": self.running,
            "remote_admitted": self.admitted,
            "remote_admitted_idle": self.admitted_idle,
            "refused_identity_budget": self.refused_identity,
            "refused_remote_budget": self.refused_total,
            "refused_remote_slots": self.refused_slots,
            "identities_tracked": len(self._identities),
        }
