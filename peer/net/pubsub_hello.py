"""Subscriptions that change while a pubsub stream is being opened reach that peer.

py-libp2p 0.8.1's `Pubsub._handle_new_peer` builds the hello packet (every topic we are
subscribed to), awaits its write, and only then registers the peer in `peers`. A topic
we join or leave during that write is announced to `peers`, which does not hold the new
peer yet, and the hello it got is already out of date: that peer never learns it, so it
never grafts us or sends us that topic's messages (measured on loopback, subscribing
4-15 ms after connecting: lost on one side or both in 11 of 72 tries, docs/libp2p.md).
Once the peer is registered we send it the difference between the hello and our topics
now.
Installed by peer/net/libp2p_fixes.py (WORKAROUND(hello-race)).
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any

from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import Pubsub

__all__ = ["install", "installed", "problem", "topics_to_announce"]

MARKER = "_prefixswarm_hello"
_HELLOS: contextvars.ContextVar[list[set[str]] | None] = contextvars.ContextVar(
    "prefixswarm_hellos", default=None
)  # the topics of each hello built by this task's _handle_new_peer


def topics_to_announce(hello: set[str], now: set[str]) -> list[tuple[str, bool]]:
    """(topic, subscribe) for each topic the hello got wrong, in a stable order."""
    joined = [(topic, True) for topic in sorted(now - hello)]
    left = [(topic, False) for topic in sorted(hello - now)]
    return joined + left


def _recording_hello(get_hello_packet: Any) -> Any:
    def hello(self: Pubsub) -> Any:
        packet = get_hello_packet(self)
        hellos = _HELLOS.get()
        if hellos is not None:
            hellos.append({sub.topicid for sub in packet.subscriptions if sub.subscribe})
        return packet

    setattr(hello, MARKER, True)
    return hello


def _announcing_changes(handle_new_peer: Any) -> Any:
    async def new_peer(self: Pubsub, peer_id: ID) -> None:
        hellos: list[set[str]] = []
        token = _HELLOS.set(hellos)  # this task's hello, not another peer's
        try:
            await handle_new_peer(self, peer_id)
        finally:
            _HELLOS.reset(token)
        queue = self.peer_queues.get(peer_id)
        if not hellos or queue is None or peer_id not in self.peers:
            return  # no hello sent here: registered already, or the stream failed
        for topic, subscribe in topics_to_announce(hellos[-1], set(self.topic_ids)):
            packet, announce = self._build_announce_rpc(topic, subscribe)
            self._enqueue_or_retry_announce(peer_id, queue, packet, announce)

    setattr(new_peer, MARKER, True)
    return new_peer


def install() -> None:
    if not getattr(Pubsub.get_hello_packet, MARKER, False):
        Pubsub.get_hello_packet = _recording_hello(Pubsub.get_hello_packet)  # type: ignore[method-assign]
    if not getattr(Pubsub._handle_new_peer, MARKER, False):
        Pubsub._handle_new_peer = _announcing_changes(Pubsub._handle_new_peer)  # type: ignore[method-assign]


def installed() -> bool:
    return all(
        getattr(method, MARKER, False)
        for method in (Pubsub.get_hello_packet, Pubsub._handle_new_peer)
    )


# what the fix wraps or calls, with the parameters it was written against
_TARGETS = (
    ("get_hello_packet", ("self",)),
    ("_handle_new_peer", ("self", "peer_id")),
    ("_build_announce_rpc", ("self", "topic_id", "subscribe")),
    ("_enqueue_or_retry_announce", ("self", "peer_id", "queue", "rpc_msg", "announce")),
)


def problem() -> str | None:
    """Why the fix cannot go in: a method it wraps or calls is missing or takes other
    parameters, or there is no `topic_ids`."""
    for name, expected in _TARGETS:
        target = getattr(Pubsub, name, None)
        if target is None:
            return f"Pubsub.{name} is missing"
        found = tuple(inspect.signature(target).parameters)
        if found != expected:
            return f"Pubsub.{name} takes {found}, expected {expected}"
    if not hasattr(Pubsub, "topic_ids"):
        return "Pubsub.topic_ids is missing"
    return None
