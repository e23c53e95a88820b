"""Gossip mode ring on real libp2p hosts over loopback, all peers in this process: ring
peers hear exactly their ring neighbours plus the version-1 peer, which hears only
its own kind (docs/protocol.md 5.4)."""

from __future__ import annotations

import dataclasses

import trio

from peer.config import GossipMode
from peer.swarm.neighbourhood import Neighbourhood
from tests.helpers_swarm import known_peers, start_peer, swarm_config, wait_until

RING_PEERS = 5
NEIGHBOURS = 2


async def test_ring_peers_hear_their_neighbours_and_understand_a_version_1_peer(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(90):
        legacy = await start_peer(nursery, swarm_config())  # gossip mode full (version 1)
        boot = legacy.peer.multiaddrs[0]
        ring = [
            await start_peer(
                nursery,
                dataclasses.replace(
                    swarm_config(bootstrap=[boot]),
                    gossip_mode=GossipMode.RING,
                    gossip_neighbours=NEIGHBOURS,
                ),
            )
            for _ in range(RING_PEERS)
        ]
        peers = [r.peer for r in ring]
        ids = {p.peer_id for p in peers}
        hoods = {p.peer_id: Neighbourhood(p.peer_id, NEIGHBOURS).select(ids) for p in peers}

        def settled() -> bool:
            return all(
                known_peers(p) == {*hoods[p.peer_id], legacy.peer.peer_id} for p in peers
            )

        took = await wait_until(settled, timeout_s=40, what="ring tables = neighbours + v1")
        print(f"ring tables settled after {took:.2f} s")
        for p in peers:
            assert p.gossip.neighbours == hoods[p.peer_id]
            assert p.statistics()["gossip"]["rejected"] == {}
        # The version-1 peer hears none of them: they publish on their ring topics only.
        assert known_peers(legacy.peer) == set()
