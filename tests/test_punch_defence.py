"""The hole-punch responder dials only where the initiator was observed, on loopback:
a stranger's Connect naming 8 ports it listens on makes the responder dial none of them
(directly: nothing to punch; through a peer that is not its relay: refused), through its
own relay at most one (at the IP the relay sees the initiator at), and never any for an
identity the relay is not connected to; punches are budgeted per relay."""

from __future__ import annotations

import ipaddress
from collections import Counter

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.net.host import open_host
from peer.net.observed import interface_networks, read_control
from peer.net.punch import Connect, Mechanism, Result, parse_message
from peer.net.punch_policy import BUDGET_BURST
from peer.net.punch_service import HOLEPUNCH_PROTOCOL

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
SCAN_PORTS = 8


def host_config(listen: tuple[str, ...]) -> PeerConfig:
    return PeerConfig(model="tiny-random", listen_addrs=listen, identity_file=None)


async def wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)


async def open_scan_targets(nursery: trio.Nursery) -> tuple[list[int], Counter[int]]:
    """SCAN_PORTS loopback listeners that count the connections they accept."""
    accepted: Counter[int] = Counter()
    ports = []
    for _ in range(SCAN_PORTS):
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        ports.append(port)

        async def count(stream: trio.SocketStream, port: int = port) -> None:
            accepted[port] += 1
            await stream.aclose()

        nursery.start_soon(trio.serve_listeners, count, [listener])
    return ports, accepted


def fresh_id() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


async def punch(stream, claimed: str, ports: list[int]) -> object | None:
    """Send a reversal Connect naming `ports` on loopback; the responder's last message
    (its Result), or None when it closed the stream without one."""
    addrs = tuple(f"/ip4/127.0.0.1/tcp/{p}" for p in ports)
    await stream.write(Connect(addrs, Mechanism.REVERSAL, claimed).encode())
    last = None
    with trio.move_on_after(15):
        try:
            while True:
                last = parse_message(await read_control(stream))
                if isinstance(last, Result):
                    break
        except Exception:  # the responder closed the stream: it refused
            pass
    await stream.reset()
    return last


async def test_a_direct_stranger_makes_the_responder_dial_nothing(nursery):
    async with open_host(host_config(LOOPBACK)) as victim, open_host(
        host_config(LOOPBACK)
    ) as stranger:
        await nursery.start(victim.reach.run)
        await nursery.start(victim.holepunch.run)
        await stranger.connect(victim.multiaddrs[0])
        ports, accepted = await open_scan_targets(nursery)
        for claimed in (stranger.peer_id.to_base58(), fresh_id()):
            stream = await stranger.libp2p.new_stream(
                victim.peer_id, [TProtocol(HOLEPUNCH_PROTOCOL)]
            )
            assert await punch(stream, claimed, ports) is None
        await trio.sleep(1.0)  # any dial would have reached a listener by now
        stats = victim.holepunch.stats
        assert stats["refused_already_direct"] == 1  # it claimed itself: connected already
        assert stats["refused_not_our_relay"] == 1  # it claimed another: not our relay
        assert sum(accepted.values()) == 0
        assert stats["dials_to_observed"] + stats["dials_to_unobserved"] == 0


async def test_through_our_relay_only_the_observed_ip_is_dialled_once(nursery):
    """H (outbound only) reserved on R; X, connected to R on loopback, punches H through
    R naming 8 ports. R sees X at 127.0.0.1 (this host: our LAN): H dials one of them,
    the first; a Connect claiming another identity than the handshake proved gets no
    dial at all."""
    async with (
        open_host(host_config(LOOPBACK)) as relay,
        open_host(host_config(())) as holder,
        open_host(host_config(LOOPBACK)) as stranger,
    ):
        for host in (relay, holder, stranger):
            await nursery.start(host.reach.run)
            await nursery.start(host.holepunch.run)
        await holder.connect(relay.multiaddrs[0])
        await stranger.connect(relay.multiaddrs[0])
        await wait_for(lambda: holder.reach.relayed_addrs() != [], "H reserved a slot on R")
        ports, accepted = await open_scan_targets(nursery)

        async def relayed() -> object:
            return await stranger.reach.open_relayed(
                holder.peer_id, HOLEPUNCH_PROTOCOL, timeout_s=10
            )

        result = await punch(await relayed(), stranger.peer_id.to_base58(), ports)
        assert isinstance(result, Result) and not result.ok
        stats = holder.holepunch.stats
        assert stats["dials_to_observed"] == 1 and stats["dials_to_unobserved"] == 0
        assert stats["addrs_refused_ports_per_ip"] == SCAN_PORTS - 1
        assert set(accepted) <= {ports[0]}  # at most the one port dialled
        # another identity than the one the end-to-end handshake proved: refused unread
        assert await punch(await relayed(), fresh_id(), ports) is None
        assert stats["bad_requests"] == 1
        assert stats["dials_to_observed"] == 1 and stats["dials_to_unobserved"] == 0
        # the relay's budget (and the initiator's own back-off): refusals, never a scan
        for _ in range(BUDGET_BURST):
            await punch(await relayed(), stranger.peer_id.to_base58(), ports)
        assert stats["refused_budget"] >= 1
        assert stats["dials_to_unobserved"] == 0
        assert set(accepted) <= {ports[0]}


def test_our_networks_include_loopback_with_its_mask():
    assert ipaddress.ip_network("127.0.0.0/8") in interface_networks()
