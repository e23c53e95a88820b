"""Admission: a bound on requests held by this peer, with a clear error when it is full.

The engine runs one step at a time; requests beyond it wait. `Admission` bounds how many
may wait (or run), so a burst gets a prompt `Overloaded` instead of an ever-growing queue.
"""

from __future__ import annotations

from types import TracebackType

# When full, clients are told to retry after about one short request's service time.
DEFAULT_RETRY_AFTER_S = 1.0


class Overloaded(Exception):
    """The peer holds as many requests as it admits; retry later or elsewhere."""

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Slot:
    """One admitted request; leaving the `with` block frees it."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._in_flight -= 1


class Admission:
    """At most `limit` requests admitted at once; the next one raises Overloaded."""

    def __init__(self, limit: int, name: str = "queue") -> None:
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.name = name
        self._in_flight = 0
        self.admitted = 0
        self.refused = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self) -> Slot:
        if self._in_flight >= self.limit:
            self.refused += 1
            raise Overloaded(f"{self.name} is full ({self.limit} requests admitted); retry later")
        self._in_flight += 1
        self.admitted += 1
        return Slot(self)

    def statistics(self) -> dict[str, int]:
        return {
            "in_flight": self._in_flight,
            "limit": self.limit,
            "admitted": self.admitted,
            "refused": self.refused,
        }
