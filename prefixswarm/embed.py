"""open_peer and PeerConfig with defaults for a peer inside another program.

A program that embeds a peer should not take the machine's well-known port or the
volunteer's identity by surprise, so the defaults here differ from `prefixswarm serve`:
the peer listens on loopback on a free port, and its identity is ephemeral. Give
`listen_addrs` and `identity_file` to join other machines under a lasting identity; the
identity is then locked while the peer runs and fixed ports are checked first, the same
checks `serve` runs (peer/preflight.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from peer import config as _config
from peer.preflight import check_model, check_peer, hold_identity

if TYPE_CHECKING:
    from peer.engine.api import EngineView
    from peer.node import Peer

__all__ = ["EMBED_LISTEN", "PeerConfig", "open_peer"]

EMBED_LISTEN = ("/ip4/127.0.0.1/tcp/0",)  # this machine only, a port the OS picks


@dataclass(frozen=True)
class PeerConfig(_config.PeerConfig):
    """peer.config.PeerConfig with embedding defaults: loopback on a free port and an
    ephemeral identity (None). Every other field, and its validation, is the same."""

    listen_addrs: tuple[str, ...] = EMBED_LISTEN
    identity_file: Path | None = None


@asynccontextmanager
async def open_peer(
    config: _config.PeerConfig | None = None, *, engine: EngineView | None = None
) -> AsyncIterator[Peer]:
    """Check the configuration, hold its identity, start the peer (Trio).

    Loads `config.model` unless `engine` is given. Raises peer.settings.ConfigError (a
    ValueError, one line) before anything starts when an address is malformed, a fixed
    listen port is taken, the model name is unknown, or another peer holds the identity.
    Leaving the block stops every service of the peer and releases the identity."""
    from peer.node import open_peer as open_node  # libp2p and trio: only when a peer starts

    config = config if config is not None else PeerConfig()
    check_peer(config)
    if engine is None:
        check_model(config.model)
    with hold_identity(config.identity_file):
        async with open_node(config, engine) as peer:
            yield peer
