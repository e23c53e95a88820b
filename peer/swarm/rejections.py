"""Summaries this peer refused, counted by reason and logged without flooding the log.

Each (sender, reason) pair is logged once at WARNING, up to a bound, so an operator sees
who sends what; repeats and pairs past the bound go to DEBUG: a rogue that sends garbage
forever costs the log one line, not one line per message. Counts are kept per reason.
"""

from __future__ import annotations

import logging

MAX_LOGGED_REJECTIONS = 256  # (sender, reason) pairs logged at WARNING; later ones at DEBUG


class Rejections:
    """Counts by reason and a bounded set of (sender, reason) pairs already warned of."""

    def __init__(self, logger: logging.Logger, max_logged: int = MAX_LOGGED_REJECTIONS) -> None:
        self._logger = logger
        self._max_logged = max_logged
        self._logged: set[tuple[str, str]] = set()
        self._counts: dict[str, int] = {}

    def reject(self, source: str, reason: str, detail: str) -> bool:
        """Count and log one refused summary; False (a validator's verdict)."""
        self.count(reason)
        key = (source, reason)
        if key not in self._logged and len(self._logged) < self._max_logged:
            self._logged.add(key)
            self._logger.warning("rejected summary from %s: %s (%s)", source, reason, detail)
        else:
            self._logger.debug("rejected summary from %s: %s (%s)", source, reason, detail)
        return False

    def count(self, reason: str) -> None:
        """Count a refusal that is logged elsewhere."""
        self._counts[reason] = self._counts.get(reason, 0) + 1

    @property
    def counts(self) -> dict[str, int]:
        """A copy of the counts by reason."""
        return dict(self._counts)
