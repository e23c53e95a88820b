"""The signed peer record that rides on every RPC, rebuilt at most once per
`RECHECK_S` instead of on every RPC.

py-libp2p 0.8.1 attaches this peer's signed record (its addresses) to every pubsub RPC,
DHT message and identify reply, through `peerstore.env_to_send_in_RPC(host)`. Each call
asks the host for its addresses (ours: the listeners' sockets, the interfaces, the
reachability verdict, a Multiaddr parse per address), parses the cached record's
addresses back to compare the two, and serialises the envelope again. A summary received
costs a receiver several of these calls (relaying it to the mesh, IDONTWANT to the
others): measured with py-spy on loopback, 10-17 % of a gossiping peer's Python time.
A record is a hint for other peers' address books, valid for hours: one at most
`RECHECK_S` old is as good. Installed by peer/net/libp2p_fixes.py (WORKAROUND(sent-record)).
"""

from __future__ import annotations

import importlib
import time
import weakref
from collections.abc import Callable
from typing import Any

import libp2p.peer.peerstore as _peerstore

__all__ = ["MODULES", "RECHECK_S", "install", "installed", "problem", "remembering"]

RECHECK_S = 1.0  # a changed address reaches the records we send within this
MARKER = "_prefixswarm_memo"
# py-libp2p modules that import env_to_send_in_RPC by name (each holds its own reference)
MODULES = (
    "libp2p.peer.peerstore",
    "libp2p.pubsub.pubsub",
    "libp2p.pubsub.gossipsub",
    "libp2p.pubsub.floodsub",
    "libp2p.identity.identify.identify",
    "libp2p.kad_dht.provider_store",
    "libp2p.kad_dht.value_store",
    "libp2p.kad_dht.peer_routing",
)
_ORIGINAL = _peerstore.env_to_send_in_RPC


def remembering(build: Callable[[Any], tuple[bytes, bool]],
                clock: Callable[[], float] = time.monotonic) -> Callable[[Any], tuple[bytes, bool]]:
    """`build(host)` (env_to_send_in_RPC's signature), answered from a per-host memo for
    `RECHECK_S` after each real build. The flag says whether a new record was issued,
    as py-libp2p's does (no caller reads it)."""
    held: weakref.WeakKeyDictionary[Any, tuple[float, bytes]] = weakref.WeakKeyDictionary()

    def env_to_send_in_RPC(host: Any) -> tuple[bytes, bool]:  # py-libp2p's name
        now = clock()
        last = held.get(host)
        if last is not None and now - last[0] < RECHECK_S:
            return last[1], False
        envelope, issued = build(host)
        held[host] = (now, envelope)
        return envelope, issued

    setattr(env_to_send_in_RPC, MARKER, True)
    return env_to_send_in_RPC


def install() -> None:
    memo = remembering(_ORIGINAL)
    for name in MODULES:
        module = importlib.import_module(name)
        if getattr(module, "env_to_send_in_RPC", None) is _ORIGINAL:
            module.env_to_send_in_RPC = memo  # type: ignore[attr-defined]


def installed() -> bool:
    return all(
        getattr(getattr(importlib.import_module(name), "env_to_send_in_RPC", None), MARKER, False)
        for name in MODULES
    )


def problem() -> str | None:
    """Why the fix cannot go in (a module lost the function or took another one)."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            return f"{name} cannot be imported: {error}"
        target = getattr(module, "env_to_send_in_RPC", None)
        if target is not _ORIGINAL and not getattr(target, MARKER, False):
            return f"{name}.env_to_send_in_RPC is not py-libp2p's peerstore function"
    return None
