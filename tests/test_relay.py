"""Reachability and relays on loopback: peers with no listen address (outbound only, like a
volunteer behind NAT) are served through a relay; a reachable peer learns it is public."""

from __future__ import annotations

import random
from typing import Any

import trio

from peer.config import PeerConfig
from peer.engine.engine import SamplingParams
from peer.pipeline import Outcome
from tests.helpers_swarm import start_peer, wait_until

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
VOCAB = 49152


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def config(listen: tuple[str, ...], bootstrap: tuple[str, ...] = (), **extra: Any) -> PeerConfig:
    return PeerConfig(
        model="tiny-random",
        listen_addrs=listen,
        bootstrap=bootstrap,
        identity_file=None,
        summary_interval_s=0.5,
        forward_first_token_s=5.0,
        forward_token_gap_s=5.0,
        **extra,
    )


async def test_outbound_only_peer_is_served_through_a_relay(nursery, tiny_engine_factory):
    relay = await start_peer(nursery, config(LOOPBACK), tiny_engine_factory())
    boot = tuple(relay.peer.multiaddrs)
    # Neither can dial the other: both have no listen address, as behind two NATs.
    holder = await start_peer(nursery, config((), boot), tiny_engine_factory())
    entry = await start_peer(nursery, config((), boot), tiny_engine_factory())
    prefix = tokens(640, seed=1)
    prompt = prefix + tokens(20, seed=2)
    await holder.peer.engine.generate(prefix + tokens(9, seed=3), SamplingParams(max_new_tokens=1))
    chain = entry.peer.engine.hasher.chain(prompt)
    await wait_until(
        lambda: entry.peer.table.estimate_match(holder.peer.peer_id, chain) >= len(prefix) // 16
        and holder.peer.host.reach.relayed_addrs() != [],
        timeout_s=20,
        what="the entry knows the holder's prefix and the holder reserved a relay slot",
    )
    assert holder.peer.reachability == "private"
    assert holder.peer.multiaddrs and all("/p2p-circuit/" in a for a in holder.peer.multiaddrs)
    assert not entry.peer.host.is_connected(holder.peer.host.peer_id)

    params = SamplingParams(max_new_tokens=8)
    result = await entry.peer.generate(prompt, params)

    assert result.served_by == holder.peer.peer_id
    assert result.cached_tokens == len(prefix)
    assert [x.outcome for x in result.route] == [Outcome.OK]
    reference = await tiny_engine_factory().generate(prompt, params)
    assert result.token_ids == reference.token_ids
    stats = relay.peer.host.reach.statistics()
    assert stats["circuits"] >= 1 and stats["reservations_granted"] >= 1
    assert entry.peer.link_to(holder.peer.peer_id) == "relayed"
    # Addresses land in the peer table (/v1/swarm shows them): the relay's, as dialled.
    await wait_until(
        lambda: any(
            v.peer_id == relay.peer.peer_id and v.addrs == tuple(relay.peer.multiaddrs)
            for v in entry.peer.table.views(trio.current_time())
        ),
        timeout_s=15,
        what="the entry's table holds the relay's advertised address",
    )
    await wait_until(
        lambda: relay.peer.reachability == "public", timeout_s=15, what="the relay is public"
    )
    assert not any("0.0.0.0" in a for a in relay.peer.multiaddrs)


async def test_a_peer_that_opted_out_relays_nothing(nursery, tiny_engine_factory):
    relay = await start_peer(
        nursery, config(LOOPBACK, relay_service=False), tiny_engine_factory()
    )
    holder = await start_peer(
        nursery, config((), tuple(relay.peer.multiaddrs)), tiny_engine_factory()
    )
    await wait_until(
        lambda: holder.peer.host.reach.stats["reservations_refused_to_us"] >= 1,
        timeout_s=15,
        what="the holder asked for a slot and was refused",
    )
    assert holder.peer.host.reach.relayed_addrs() == []
    assert relay.peer.host.reach.statistics()["reservations_held_for_others"] == 0
