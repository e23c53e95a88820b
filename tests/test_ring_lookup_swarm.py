"""Gossip mode ring's lookup on real libp2p hosts over loopback (tiny-random engines, all
in this process): an entry peer that does not hear the holder of a prefix still finds it
through the root's home peers, routes the request there (same greedy tokens as local
execution) and keeps hearing it; a home without the roots protocol (a peer of the
previous version) is refused cleanly and skipped (docs/protocol.md 5.4)."""

from __future__ import annotations

import dataclasses

import trio

from peer.config import GossipMode, Policy
from peer.engine.engine import SamplingParams
from peer.request.pipeline import Outcome
from peer.swarm.neighbourhood import Neighbourhood
from peer.swarm.providers import HomeRing
from protocols.ids import ROOTS_PROTOCOL
from tests.helpers_swarm import start_peer, wait_until
from tests.test_pipeline import config, reference, tokens

PEERS = 5
NEIGHBOURS = 2


async def test_an_entry_peer_finds_a_holder_beyond_its_ring_and_routes_there(
    nursery: trio.Nursery, tiny_engine_factory
) -> None:
    with trio.fail_after(90):
        ring_config = dataclasses.replace(
            config(), gossip_mode=GossipMode.RING, gossip_neighbours=NEIGHBOURS,
            # the longest match decides: under COST a tiny-random prompt recomputes in
            # less than two round trips of a loaded loopback, so the entry would rightly
            # replicate it (REPLICATE, peer/routing/cost.py) and the route would not show the
            # lookup
            policy=Policy.LONGEST_PREFIX,
            lookup_wait_s=5.0,  # five peers in one process on a CPU that make test's other
            #   worker loads: streams take ~0.1-0.5 s here, not the few ms of an idle
            #   loopback, and a lookup past its budget runs the request locally
        )
        first = await start_peer(nursery, ring_config, tiny_engine_factory())
        rest = [
            await start_peer(
                nursery,
                dataclasses.replace(ring_config, bootstrap=tuple(first.peer.multiaddrs)),
                tiny_engine_factory(),
            )
            for _ in range(PEERS - 1)
        ]
        peers = [first.peer, *(r.peer for r in rest)]
        ids = [p.peer_id for p in peers]
        hoods = {p: Neighbourhood(p, NEIGHBOURS).select(ids) for p in ids}
        await wait_until(
            lambda: all(p.gossip.neighbours == hoods[p.peer_id] for p in peers),
            timeout_s=40, what="every ring peer chose its neighbours among all",
        )
        # the entry, a holder it does not hear, and a peer without the roots protocol
        # (as a peer of the previous version) that is the first home of the prompt's root
        entry = peers[0]
        holder = next(p for p in peers[1:] if p.peer_id not in hoods[entry.peer_id])
        old = next(p for p in peers[1:] if p is not holder)
        old.host.libp2p.remove_stream_handler(ROOTS_PROTOCOL)
        ring = HomeRing()
        ring.update(ids)
        hasher = entry.engine.hasher
        seed = next(
            s for s in range(10_000)
            if ring.homes(hasher.chain(tokens(16, s))[0], 0.0)[0] == old.peer_id
        )
        prefix = tokens(16, seed) + tokens(304, seed + 1)  # 20 blocks, the root ground above
        prompt = prefix + tokens(20, seed + 2)
        root = hasher.chain(prefix[:16])[0]
        await holder.engine.generate(prefix + tokens(9, seed + 3), SamplingParams(max_new_tokens=1))
        second_home = next(p for p in peers if p.peer_id == ring.homes(root, 0.0)[1])

        def recorded() -> bool:
            providers = second_home.lookup.index.providers(root, trio.current_time())
            return holder.peer_id in providers

        await wait_until(recorded, timeout_s=20, what="the holder's root reached its home")
        assert entry.table.estimate_match(holder.peer_id, hasher.chain(prompt)) == 0

        params = SamplingParams(max_new_tokens=8)
        result = await entry.generate(prompt, params)

        why = f"{result.route} {entry.lookup.statistics()}"
        assert result.served_by == holder.peer_id, why
        assert result.cached_tokens == len(prefix)
        assert [a.outcome for a in result.route] == [Outcome.OK]
        assert result.token_ids == await reference(tiny_engine_factory, prompt, params)
        stats = entry.lookup.statistics()
        assert stats["lookups"] == 1 and stats["summaries_fetched"] == 1
        assert stats["finds_failed"] == 1  # the old peer was asked first, refused, skipped
        assert holder.peer_id in entry.lookup.lookups.interest.members
        await wait_until(
            lambda: holder.peer_id in entry.gossip.listening,
            timeout_s=10, what="the entry subscribed to the holder's ring topic",
        )
