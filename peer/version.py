"""The installed prefixswarm version (`--version`, GET /version)."""

from __future__ import annotations

import itertools
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

UNKNOWN_VERSION = "0+unknown"  # running from a checkout that was never pip-installed


def version() -> str:
    try:
        return _distribution_version("prefixswarm")
    except PackageNotFoundError:
        return UNKNOWN_VERSION


def release(software: str) -> tuple[int, ...]:
    """The numeric release of a "prefixswarm/1.2.3+local" string: (1, 2, 3); () unsaid."""
    numbers: list[int] = []
    for part in software.rpartition("/")[2].split("+", 1)[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def is_older(theirs: str, ours: str) -> bool:
    """Whether a peer's software is older than ours (one that does not say counts as older)."""
    return release(theirs) < release(ours)
