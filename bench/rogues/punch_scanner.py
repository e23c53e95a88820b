"""punch_scanner: hole-punch Connects that name 8 loopback ports, to make peers scan.

Listens on SCAN_PORTS loopback ports of its own (standing for services on the
volunteer's host: the rogue runs on the same machine as the bench's peers) and counts
every TCP connection they accept: a connection there is a dial the honest peer made to
an address of the rogue's choosing. Every SCAN_INTERVAL_S, to every peer it is connected
to, it sends Connects naming those ports: over its own connection claiming its own id
(what a naive responder dials at once), claiming a fresh id, and through every other
peer as a relay (refused unless the target reserved a slot there), alternating reversal
and simultaneous open (with its Sync). Counts go into the rogue's `answered` stats:
punch_connects_sent, scan_connections (TCP connections accepted), scan_ports_hit.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from peer.net.punch import Connect, Mechanism, Sync

SCAN_PORTS = 8  # the Connect: 8 loopback ports
SCAN_INTERVAL_S = 2.0  # a round of Connects to every connected peer this often
STREAM_TIMEOUT_S = 5.0  # open, write and linger on one punch stream
LINGER_S = 1.0  # keep a stream open this long: a reversal's dials happen meanwhile
HOLEPUNCH_PROTOCOL = "/prefixswarm/holepunch/1.0.0"


def install(peer: Any, answered: Counter[str]) -> None:
    """Start the scan loop on a running rogue `peer`; counts land in `answered`."""
    peer.start_soon(_scan, peer, answered)


async def _scan(peer: Any, answered: Counter[str]) -> None:
    hits: Counter[int] = Counter()
    async with trio.open_nursery() as nursery:
        ports = [await _listen(nursery, hits, answered) for _ in range(SCAN_PORTS)]
        addrs = tuple(f"/ip4/127.0.0.1/tcp/{p}" for p in ports)
        me = peer.host.peer_id.to_base58()
        round_ = 0
        while True:
            round_ += 1
            mechanism = Mechanism.REVERSAL if round_ % 2 else Mechanism.SIMULTANEOUS_OPEN
            for target in peer.host.connected_peers():
                stranger = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
                for claimed in (me, stranger):
                    nursery.start_soon(_direct, peer, target, Connect(addrs, mechanism, claimed),
                                       answered)
                nursery.start_soon(_relayed, peer, target, Connect(addrs, mechanism, me),
                                   answered)
            answered["scan_ports_hit"] = len(hits)
            await trio.sleep(SCAN_INTERVAL_S)


async def _listen(nursery: trio.Nursery, hits: Counter[int], answered: Counter[str]) -> int:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = int(listener.socket.getsockname()[1])

    async def count(stream: trio.SocketStream) -> None:
        hits[port] += 1
        answered["scan_connections"] += 1
        answered["scan_ports_hit"] = len(hits)
        await stream.aclose()

    nursery.start_soon(trio.serve_listeners, count, [listener])
    return port


async def _send(stream: Any, hello: Connect, answered: Counter[str]) -> None:
    try:
        await stream.write(hello.encode())
        answered["punch_connects_sent"] += 1
        if hello.mechanism is Mechanism.SIMULTANEOUS_OPEN:
            await trio.sleep(0.05)
            await stream.write(Sync().encode())
        await trio.sleep(LINGER_S)
    finally:
        with contextlib.suppress(Exception):  # already reset by the other side
            await stream.reset()


async def _direct(peer: Any, target: ID, hello: Connect, answered: Counter[str]) -> None:
    with trio.move_on_after(STREAM_TIMEOUT_S), contextlib.suppress(Exception):
        stream = await peer.host.libp2p.new_stream(target, [TProtocol(HOLEPUNCH_PROTOCOL)])
        await _send(stream, hello, answered)


async def _relayed(peer: Any, target: ID, hello: Connect, answered: Counter[str]) -> None:
    reach = peer.host.reach
    if reach is None:
        return
    with trio.move_on_after(STREAM_TIMEOUT_S), contextlib.suppress(Exception):
        stream = await reach.open_relayed(target, HOLEPUNCH_PROTOCOL, timeout_s=STREAM_TIMEOUT_S)
        answered["punch_relayed_streams"] += 1
        await _send(stream, hello, answered)
