"""One directed emulated link: a FIFO with a bandwidth cap, a one-way delay and a bounded
backlog (drop-tail), as a pure schedule.

    link = LinkSchedule(delay_s=0.02, bandwidth_bps=20e6, max_backlog_bytes=250_000)
    at = link.admit(now, len(packet))   # delivery time, or None: dropped (backlog full)

A packet is serialised onto the link after the ones before it (at `bandwidth_bps`), then
travels `delay_s`; it is delivered at finish + delay, never before a packet admitted
earlier (FIFO, also across a change of delay). The backlog is the bytes admitted but not
yet serialised at `now`; a packet that would push it past `max_backlog_bytes` is dropped,
as a router's full queue drops it. Time is a parameter; the emulator passes its clock.
"""

from __future__ import annotations

import math

UNLIMITED = math.inf  # a bandwidth without a cap: packets are serialised in no time


class LinkSchedule:
    """Delivery times for the packets of one direction of one link (see the module doc)."""

    def __init__(self, delay_s: float, bandwidth_bps: float, max_backlog_bytes: int) -> None:
        self.delay_s = delay_s
        self.bandwidth_bps = bandwidth_bps
        self.max_backlog_bytes = max_backlog_bytes
        self._busy_until = -math.inf  # when the last admitted packet finishes serialising
        self._last_delivery = -math.inf

    @property
    def delay_s(self) -> float:
        return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        if not value >= 0 or math.isinf(value):
            raise ValueError(f"delay_s must be finite and >= 0, got {value!r}")
        self._delay_s = value

    @property
    def bandwidth_bps(self) -> float:
        return self._bandwidth_bps

    @bandwidth_bps.setter
    def bandwidth_bps(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"bandwidth_bps must be > 0 (math.inf: no cap), got {value!r}")
        self._bandwidth_bps = value

    @property
    def max_backlog_bytes(self) -> int:
        return self._max_backlog_bytes

    @max_backlog_bytes.setter
    def max_backlog_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"max_backlog_bytes must be >= 0, got {value!r}")
        self._max_backlog_bytes = value

    def backlog_bytes(self, now: float) -> float:
        """Bytes admitted but not yet serialised at `now` (0 on an idle or uncapped link)."""
        if self._busy_until <= now or math.isinf(self._bandwidth_bps):
            return 0.0
        return (self._busy_until - now) * self._bandwidth_bps / 8

    def admit(self, now: float, size: int) -> float | None:
        """The delivery time of a `size`-byte packet offered at `now`; None when dropped.

        Calls must come with non-decreasing `now` (the emulator's clock)."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size!r}")
        if self.backlog_bytes(now) + size > self._max_backlog_bytes:
            return None
        start = max(now, self._busy_until)
        finish = start + size * 8 / self._bandwidth_bps
        self._busy_until = finish
        delivery = max(finish + self._delay_s, self._last_delivery)
        self._last_delivery = delivery
        return delivery
