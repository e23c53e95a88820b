"""The installed prefixswarm version (`--version`, GET /version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

UNKNOWN_VERSION = "0+unknown"  # running from a checkout that was never pip-installed


def version() -> str:
    try:
        return _distribution_version("prefixswarm")
    except PackageNotFoundError:
        return UNKNOWN_VERSION
