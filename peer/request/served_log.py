"""Which peers asked this one for which prompts, lately: what the served-for protocol
(protocols/served.py) answers from.

Every forwarded request this peer serves is recorded as (prompt digest, requester). An
entry checking a probation peer's answer asks: did that peer ask you for this prompt? A
yes means the probation peer obtained its answer here instead of computing it
(laundering). Pure (time is a parameter) and bounded: at most `capacity` records, none
older than `window_s`, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 4096  # records: ~100 bytes each; a busy peer serves fewer in the window
DEFAULT_WINDOW_S = 300.0  # a shadow's answer is checked within seconds of being served


class ServedLog:
    """(prompt digest, requester) pairs served lately, each with when."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 window_s: float = DEFAULT_WINDOW_S) -> None:
        if capacity < 1 or window_s <= 0:
            raise ValueError("capacity must be >= 1 and window_s > 0")
        self._capacity = capacity
        self._window_s = window_s
        self._at: OrderedDict[tuple[bytes, str], float] = OrderedDict()

    def record(self, digest: bytes, requester: str, now: float) -> None:
        """`requester` asked for the prompt of `digest` at `now`."""
        key = (digest, requester)
        self._at.pop(key, None)
        self._at[key] = now
        self._forget(now)
        while len(self._at) > self._capacity:
            self._at.popitem(last=False)

    def asked(self, digest: bytes, requester: str, now: float) -> bool:
        """Whether `requester` asked for the prompt of `digest` within the window."""
        self._forget(now)
        return (digest, requester) in self._at

    def _forget(self, now: float) -> None:
        while self._at:
            key, at = next(iter(self._at.items()))
            if now - at <= self._window_s:
                return
            del self._at[key]

    def __len__(self) -> int:
        return len(self._at)
