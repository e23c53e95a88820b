"""The two kinds of error: the remote side misbehaved, or our own code misused an API.

Decoders of bytes that came from the network raise only `RemoteProtocolError`. Misuse by
our own code (a bad argument, an oversize message we tried to send) raises `ValueError`
or `TypeError` as usual, so a bug here never looks like a misbehaving peer.
"""

from __future__ import annotations

__all__ = ["RemoteProtocolError"]


class RemoteProtocolError(Exception):
    """The remote side sent something invalid (malformed, oversize, out of bounds)."""
