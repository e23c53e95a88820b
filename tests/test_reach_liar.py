"""A peer behind NAT stays PRIVATE and keeps its relays when a connected peer answers its
dial-back "ok" at an address of its choosing (bench/rogues/reachability_liar.py), on
loopback: H listens on 127.0.0.2 but connects out from 127.0.0.1, so an honest dial-back
(to the IP H is seen at, on H's port) finds nobody, as behind a NAT."""

from __future__ import annotations

import types
from collections import Counter

import trio

from bench.rogues.reachability_liar import LIE_IP
from bench.rogues.reachability_liar import install as install_liar
from peer.config import PeerConfig
from peer.net.reachability import Reachability


def host_config(listen: tuple[str, ...]) -> PeerConfig:
    return PeerConfig(model="tiny-random", listen_addrs=listen, identity_file=None)


async def wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)


async def test_one_lying_ok_neither_flips_a_natted_peer_nor_takes_its_relays(nursery):
    from peer.net.host import open_host

    async with (
        open_host(host_config(("/ip4/127.0.0.1/tcp/0",))) as relay,
        open_host(host_config(("/ip4/127.0.0.1/tcp/0",))) as liar,
        open_host(host_config(("/ip4/127.0.0.2/tcp/0",))) as natted,
    ):
        lies: Counter[str] = Counter()
        install_liar(types.SimpleNamespace(host=liar), lies)
        await nursery.start(relay.reach.run)
        await natted.connect(relay.multiaddrs[0])
        await natted.connect(liar.multiaddrs[0])
        await nursery.start(natted.reach.run)  # its first check asks both
        await wait_for(lambda: lies["dialback_lies"] >= 1, "the liar was asked and lied")
        await wait_for(lambda: natted.reach.stats["dialbacks_failed"] >= 1, "R's dial-back")
        await wait_for(lambda: natted.reach.relayed_addrs() != [], "H reserved a relay slot")
        assert natted.reachability() is Reachability.PRIVATE
        assert natted.reach.stats["dialbacks_ok"] >= 1  # the lie was received, and outvoted
        assert not any(LIE_IP in a for a in natted.multiaddrs)
        assert all("/p2p-circuit/" in a for a in natted.multiaddrs)
        await trio.sleep(3.0)  # reservations are re-checked every 2 s: still held
        assert natted.reachability() is Reachability.PRIVATE
        assert natted.reach.relayed_addrs() != []
