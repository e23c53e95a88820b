"""RequestLog: the last requests this peer entered, with their routes (pure, bounded).

The peer's page (GET /v1/requests) shows it: for each request, every candidate that was
tried, the reason the router gave for it, its outcome, and what the request got in the
end (served by, cached tokens, time to first token). Records are added when a request
ends (`record`, with `now` from the caller's monotonic clock) and read newest first with
their age (`as_json(now)`). Nothing here knows about trio, libp2p or torch.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

MAX_RECENT_REQUESTS = 50  # a page's worth; one record is well under 2 kB of JSON
MAX_TEXT_CHARS = 400  # a reason or error sentence; longer ones are cut (a peer id is 52)


class RequestOutcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # no candidate could serve it
    OVERLOADED = "overloaded"  # refused: this peer or every candidate was full
    DEADLINE = "deadline"  # its end-to-end deadline passed
    CANCELLED = "cancelled"  # the client went away before it ended


class AttemptLike(Protocol):
    """What the log reads of a pipeline Attempt."""

    @property
    def peer_id(self) -> str: ...
    @property
    def is_local(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def outcome(self) -> enum.Enum: ...
    @property
    def detail(self) -> str: ...
    @property
    def tokens(self) -> int: ...


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…"


@dataclass(frozen=True)
class RouteStep:
    """One candidate tried: why the router chose it and what came of it."""

    peer_id: str
    is_local: bool
    reason: str  # the router's account of its ranking ("" when not given)
    outcome: str  # an Outcome value of the pipeline: ok, refused, failed, stalled, ...
    detail: str  # why it failed ("" on success)
    tokens: int  # tokens it contributed

    @classmethod
    def of(cls, attempt: AttemptLike) -> RouteStep:
        return cls(
            peer_id=attempt.peer_id,
            is_local=attempt.is_local,
            reason=_cut(attempt.reason),
            outcome=str(attempt.outcome.value),
            detail=_cut(attempt.detail),
            tokens=attempt.tokens,
        )


@dataclass(frozen=True)
class RequestRecord:
    """One request that ended here (this peer was its entry)."""

    request_id: str
    ended_at: float  # monotonic seconds, the caller's clock
    outcome: RequestOutcome
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # None: no token came
    total_s: float | None = None
    served_by: str = ""  # the peer that produced the last token ("" if none)
    route: tuple[RouteStep, ...] = ()
    error: str = ""

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "age_s": round(max(0.0, now - self.ended_at), 3),
            "outcome": self.outcome.value,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "total_s": None if self.total_s is None else round(self.total_s, 6),
            "served_by": self.served_by,
            "route": [
                {
                    "peer_id": s.peer_id, "local": s.is_local, "reason": s.reason,
                    "outcome": s.outcome, "detail": s.detail, "tokens": s.tokens,
                }
                for s in self.route
            ],
            "error": self.error,
        }


def route_of(attempts: Iterable[AttemptLike]) -> tuple[RouteStep, ...]:
    return tuple(RouteStep.of(a) for a in attempts)


class RequestLog:
    """The last `capacity` requests, and counts of every request by outcome."""

    def __init__(self, capacity: int = MAX_RECENT_REQUESTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self._outcomes: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, record: RequestRecord) -> None:
        self._records.append(record)
        self._outcomes[record.outcome.value] += 1

    def records(self) -> list[RequestRecord]:
        """Newest first."""
        return list(reversed(self._records))

    def as_json(self, now: float) -> list[dict[str, Any]]:
        return [r.as_json(now) for r in reversed(self._records)]

    def statistics(self) -> dict[str, int]:
        """Requests ended here since start, by outcome (not only the ones kept)."""
        return {o.value: self._outcomes[o.value] for o in RequestOutcome}


# -- this peer's cache over time ---------------------------------------------------------

MAX_HISTORY_SAMPLES = 360  # one a summary interval: 6 minutes at 1 s, 12 at the default 2 s


@dataclass(frozen=True)
class CacheSample:
    """The engine's counters at one moment (cumulative tokens since start)."""

    at: float  # monotonic seconds
    prompt_tokens: int
    cached_tokens: int
    cached_blocks: int
    capacity_blocks: int


class CacheHistory:
    """The last `capacity` samples of this peer's prefix hits and cache fill."""

    def __init__(self, capacity: int = MAX_HISTORY_SAMPLES) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        self._samples: deque[CacheSample] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: CacheSample) -> None:
        self._samples.append(sample)

    def as_json(self, now: float) -> list[dict[str, Any]]:
        """Oldest first: the hit ratio since start, the hit ratio of the prompt tokens since
        the previous sample (None when there were none), and the cache fill (0 to 1)."""
        out = []
        previous: CacheSample | None = None
        for s in self._samples:
            window = None
            if previous is not None and s.prompt_tokens > previous.prompt_tokens:
                window = (s.cached_tokens - previous.cached_tokens) / (
                    s.prompt_tokens - previous.prompt_tokens
                )
            out.append({
                "age_s": round(max(0.0, now - s.at), 3),
                "hit_ratio": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else None,
                "window_hit_ratio": window,
                "fill": s.cached_blocks / s.capacity_blocks if s.capacity_blocks else None,
            })
            previous = s
        return out
