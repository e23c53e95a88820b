"""The py-libp2p services a peer runs on its host: the Kademlia DHT and GossipSub.

Thin calls around py-libp2p 0.8.1's KadDHT and GossipSub, each workaround marked
`WORKAROUND(n)` as in peer/net/host.py (numbers in docs/libp2p.md).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from peer.net.host import SwarmHost
from peer.net.wire import PeerUnreachable

logger = logging.getLogger(__name__)

DHT_QUERY_TIMEOUT_S = 5.0  # one GET_PROVIDERS round trip; libp2p's own is 10 s per peer
# Raised from libp2p's 10/s: that limit counts every message a neighbour relays on the
# topic (all origins), so 10/s caps a 2 s-interval swarm at ~20 peers. Our validator
# bounds the per-origin cost instead (PeerTable rejects non-increasing seq).
GOSSIP_MAX_MESSAGES_PER_S = 200.0


@asynccontextmanager
async def run_service(service: object) -> AsyncIterator[None]:
    """Run a py-libp2p Service (DHT, Pubsub, GossipSub) for the duration of the block."""
    async with background_trio_service(service):  # type: ignore[arg-type]
        yield


def new_dht(host: SwarmHost) -> KadDHT:
    """A Kademlia DHT in server mode (every peer stores provider records)."""
    # WORKAROUND(8): protocol_prefix is ignored (the wire id is always /ipfs/kad/1.0.0),
    # so it is not passed; our provider key is namespaced instead (protocols.ids).
    return KadDHT(host.libp2p, DHTMode.SERVER, enable_random_walk=False)


async def dht_add_peer(dht: KadDHT, peer_id: ID) -> bool:
    """Put a connected peer into the routing table.

    WORKAROUND(6): new connections are not added to the DHT routing table (its refresh
    runs at start and every 600 s), so lookups would not know our neighbours."""
    try:
        with trio.move_on_after(DHT_QUERY_TIMEOUT_S):
            return bool(await dht.add_peer(peer_id))
    except Exception as exc:  # the routing table may probe the peer; any failure = no
        logger.debug("dht add_peer %s: %s", peer_id, exc)
    return False


def dht_forget_peer(dht: KadDHT, key: bytes, peer_id: ID) -> None:
    """Drop a dead peer from the routing table and from our local provider records."""
    dht.routing_table.remove_peer(peer_id)
    # WORKAROUND(7): the local provider store keeps dead providers for 48 h and
    # find_providers answers from it; remove the record of a peer we found dead.
    records = dht.provider_store.providers.get(key)
    if records is not None:
        records.pop(str(peer_id), None)


def dht_local_providers(dht: KadDHT, key: bytes) -> list[PeerInfo]:
    """Provider records we hold ourselves (others' ADD_PROVIDER, our own)."""
    return list(dht.provider_store.get_providers(key))


async def dht_provide(dht: KadDHT, key: bytes, *, timeout_s: float) -> bool:
    """Announce that we provide `key` (multihash bytes) to the closest peers we find.

    Calls the provider store with the key bytes, as KadDHT.provide(cid_str) would after
    parsing the CID (protocols.ids.provider_key is that CID string)."""
    with trio.move_on_after(timeout_s):
        return bool(await dht.provider_store.provide(key))
    return False


async def dht_query_providers(
    dht: KadDHT, peer_id: ID, key: bytes, *, timeout_s: float = DHT_QUERY_TIMEOUT_S
) -> list[PeerInfo]:
    """Ask one peer for the providers of `key` it knows.

    WORKAROUND(7b): KadDHT.find_providers returns the local store without asking
    anyone once it holds any record -- and we always hold our own, so it would never
    find other peers. Ask a peer directly instead (GET_PROVIDERS)."""
    with trio.move_on_after(timeout_s):
        store = dht.provider_store
        providers, _closer = await store._get_providers_from_peer_with_closers(peer_id, key)
        return list(providers)
    raise PeerUnreachable(f"GET_PROVIDERS to {peer_id} timed out after {timeout_s} s")


def new_pubsub(host: SwarmHost, *, degree: int, degree_low: int, degree_high: int) -> Pubsub:
    """GossipSub v1.1/v1.2 with signed messages; run both `pubsub` and `pubsub.router`."""
    router = GossipSub(
        [PROTOCOL_ID_V12, PROTOCOL_ID_V11],
        degree=degree,
        degree_low=degree_low,
        degree_high=degree_high,
        # WORKAROUND(2): defaults are heartbeat 120 s and prune back-off 60 s; a mesh
        # then stays empty for minutes ("GRAFT flood detected"). 1 s / 5 s heal it.
        heartbeat_interval=1,
        prune_back_off=5,
        max_messages_per_topic_per_second=GOSSIP_MAX_MESSAGES_PER_S,
        # WORKAROUND(adaptive-heartbeat): "adaptive gossip" rates the mesh's health
        # every 30 s and, when it rates it below 0.7, sets the heartbeat to
        # max(60, 0.75 x ours) s (below 0.4: 30 s), a rule written for the 120 s default.
        # With scoring weights at 0 no peer ever scores above 0 and a newly connected
        # swarm rates ~0.67 (seen in an 8-process swarm: heartbeat 1 s -> 60 s), so
        # the mesh goes unrepaired and no IHAVE gossip leaves for a minute.
        adaptive_gossip_enabled=False,
    )
    # strict_signing (the default) signs our messages and verifies everyone's (ed25519).
    return Pubsub(host.libp2p, router, strict_signing=True)
