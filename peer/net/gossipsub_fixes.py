"""GossipSub's mesh, patched (applied by peer/net/libp2p_fixes.py, which checks each
target first): both sides of a PRUNE back off, and each waits a little longer before
grafting than it takes to accept a GRAFT (WORKAROUND(prune-backoff)), no
opportunistic grafting (WORKAROUND(opportunistic-graft)), and IHAVE gossip to backed-off
peers (WORKAROUND(gossip-backoff)). libp2p_fixes.fixes() says why each one is needed.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub

__all__ = [
    "GOSSIP_FACTOR",
    "GOSSIP_LAZY_PEERS",
    "PRUNE_BACKOFF_SLACK_S",
    "back_off_from_peers_we_prune",
    "gossip_to_backed_off_peers",
    "no_opportunistic_grafting",
]

PRUNE_BACKOFF_SLACK_S = 2  # after a PRUNE, either side grafts the other only once the
#   back-off plus this has passed, but accepts its GRAFT as soon as the back-off itself
#   has (go-libp2p's slack of heartbeats): the two sides start their clocks a network
#   delay apart and py-libp2p rounds back-offs to whole seconds. Were one side to hold
#   out longer than the other waits, each early GRAFT would be refused with a PRUNE that
#   renews both back-offs, over and over: the pair never meshes again
GOSSIP_LAZY_PEERS = 6  # IHAVE goes to at least this many non-mesh peers per heartbeat...
GOSSIP_FACTOR = 0.25  # ...or this share of them, whichever is more (GossipSub's D_lazy
#   and gossip factor; py-libp2p's own values with its adaptive gossip off)


def back_off_from_peers_we_prune() -> None:
    for name, patched in (
        ("mesh_heartbeat", _backing_off_pruned),
        ("emit_prune", _backing_off_on_prune),
        ("handle_prune", _slack_after_prune_received),
        ("handle_graft", _graft_accepted_after_back_off),
    ):
        method = getattr(GossipSub, name)
        if not getattr(method, "_prefixswarm", False):
            setattr(GossipSub, name, patched(method))


def _back_off_after_our_prune(router: GossipSub, peer: ID, topic: str, unsubscribing: bool) -> None:
    """We pruned `peer` from `topic`'s mesh: do not graft it for the back-off we asked of
    it, plus the slack."""
    back_off = router.unsubscribe_back_off if unsubscribing else router.prune_back_off
    router._add_back_off(peer, topic, unsubscribing, back_off + PRUNE_BACKOFF_SLACK_S)


def _back_off_proper_ended(router: GossipSub, peer: ID, topic: str) -> None:
    """A GRAFT from `peer`: forget its back-off if only the slack is left of it. Every
    back-off we record carries the slack, which delays our own GRAFTs, not theirs."""
    peers = router.back_off.get(topic, {})
    until = peers.get(peer)
    if until is not None and until - PRUNE_BACKOFF_SLACK_S <= int(time.time()):
        del peers[peer]


def _forget_expired_back_offs(router: GossipSub) -> None:
    """py-libp2p deletes a back-off only when it checks that very (topic, peer): entries
    for topics no longer heard (ring mode) would pile up."""
    now = int(time.time())  # py-libp2p's back-off clock, whole seconds
    for topic in list(router.back_off):
        peers = router.back_off[topic]
        for peer in [p for p, until in peers.items() if until <= now]:
            del peers[peer]
        if not peers:
            del router.back_off[topic]


def _backing_off_pruned(mesh_heartbeat: Any) -> Any:
    def heartbeat(self: GossipSub) -> Any:
        _forget_expired_back_offs(self)
        to_graft, to_prune = mesh_heartbeat(self)
        for peer, topics in to_prune.items():
            for topic in topics:
                _back_off_after_our_prune(self, peer, topic, False)
        return to_graft, to_prune

    heartbeat._prefixswarm = True  # type: ignore[attr-defined]
    return heartbeat


def _backing_off_on_prune(emit_prune: Any) -> Any:
    async def prune(
        self: GossipSub, topic: str, to_peer: ID, do_px: bool, is_unsubscribe: bool
    ) -> None:
        _back_off_after_our_prune(self, to_peer, topic, is_unsubscribe)
        await emit_prune(self, topic, to_peer, do_px, is_unsubscribe)

    prune._prefixswarm = True  # type: ignore[attr-defined]
    return prune


def _slack_after_prune_received(handle_prune: Any) -> Any:
    async def prune(self: GossipSub, prune_msg: Any, sender_peer_id: ID) -> None:
        back_off = prune_msg.backoff if prune_msg.backoff > 0 else self.prune_back_off
        slacked = back_off + PRUNE_BACKOFF_SLACK_S
        self._add_back_off(sender_peer_id, prune_msg.topicID, False, slacked)
        await handle_prune(self, prune_msg, sender_peer_id)

    prune._prefixswarm = True  # type: ignore[attr-defined]
    return prune


def _graft_accepted_after_back_off(handle_graft: Any) -> Any:
    async def graft(self: GossipSub, graft_msg: Any, sender_peer_id: ID) -> None:
        _back_off_proper_ended(self, sender_peer_id, graft_msg.topicID)
        await handle_graft(self, graft_msg, sender_peer_id)

    graft._prefixswarm = True  # type: ignore[attr-defined]
    return graft


def no_opportunistic_grafting() -> None:
    GossipSub._perform_opportunistic_grafting = (  # type: ignore[method-assign]
        _graft_no_one
    )


def _graft_no_one(self: GossipSub, topic: str, peers_to_graft: Any) -> int:
    return 0


_graft_no_one._prefixswarm = True  # type: ignore[attr-defined]


def gossip_to_backed_off_peers() -> None:
    GossipSub.gossip_heartbeat = _gossip_heartbeat  # type: ignore[method-assign]


def _gossip_heartbeat(self: GossipSub) -> defaultdict[ID, dict[str, list[bytes]]]:
    """{peer: {topic: message ids}}: the IHAVE each peer gets this heartbeat."""
    to_gossip: defaultdict[ID, dict[str, list[bytes]]] = defaultdict(dict)
    if self.pubsub is None:
        return to_gossip
    gossipsub = {p for p in self.protocols if p != _FLOODSUB_PROTOCOL}
    heard = [*self.mesh.items(), *((t, p) for t, p in self.fanout.items() if t not in self.mesh)]
    for topic, current in heard:
        msg_ids = self.mcache.window(topic)
        if not msg_ids:
            continue
        candidates = [
            peer
            for peer in self.pubsub.peer_topics.get(topic, ())
            if peer not in current
            and peer not in self.direct_peers
            and self.peer_protocol.get(peer) in gossipsub
        ]
        count = max(GOSSIP_LAZY_PEERS, int(len(candidates) * GOSSIP_FACTOR))
        for peer in _RANDOM.sample(candidates, min(count, len(candidates))):
            to_gossip[peer][topic] = list(msg_ids)
    return to_gossip


_gossip_heartbeat._prefixswarm = True  # type: ignore[attr-defined]
_FLOODSUB_PROTOCOL = "/floodsub/1.0.0"
_RANDOM = random.Random()  # which peers get IHAVE; any spread will do
