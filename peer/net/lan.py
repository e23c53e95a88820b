"""Peers on the same LAN find each other by multicast DNS: no address to copy.

py-libp2p 0.8.1's mDNS (zeroconf underneath) announces our addresses as `dnsaddr` TXT
records under _p2p._udp.local and reports peers it hears of from zeroconf's thread; we
hand them to the trio loop through a bounded channel and dial them. From the first
connection on, the DHT and gossip find the rest of the swarm as after a bootstrap.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.mdns import MDNSDiscovery
from libp2p.peer.peerinfo import PeerInfo

from peer.net.host import SwarmHost
from peer.net.reachability import expand_unspecified, is_circuit
from peer.net.relay_service import interface_ips
from peer.net.wire import PeerUnreachable

logger = logging.getLogger(__name__)

FOUND_BACKLOG = 64  # peers heard of but not yet dialled; more are dropped (heard again later)
MDNS_TTL_S = 120  # how long a peer's announced addresses stay in the peerstore


class LanDiscovery:
    """Announce this peer on the LAN and dial the peers announced there."""

    def __init__(self, host: SwarmHost, *, on_connect: Callable[[], None] = lambda: None) -> None:
        self._host = host
        self._on_connect = on_connect
        self.found = 0
        self.connected = 0

    def _announced(self) -> tuple[int, list[str]]:
        ips = [ip for ip in interface_ips() if not ip.startswith("127.")] or ["127.0.0.1"]
        addrs: list[str] = []
        port = 0
        for addr in self._host.libp2p.get_transport_addrs():
            text = str(addr)
            if is_circuit(text) or "/tcp/" not in text:
                continue
            port = port or int(text.split("/tcp/")[1].split("/")[0])
            addrs += expand_unspecified(text, ips)
        return port, addrs

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        port, addrs = self._announced()
        if not addrs:
            logger.warning("mDNS: no listen address to announce (outbound only); not started")
            task_status.started()
            return
        send, receive = trio.open_memory_channel[PeerInfo](FOUND_BACKLOG)
        token = trio.lowlevel.current_trio_token()

        def offer(info: PeerInfo) -> None:  # in the trio thread
            # A full backlog drops it: announcements repeat, it will be heard again.
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
                send.send_nowait(info)

        def heard(info: PeerInfo) -> None:  # in zeroconf's thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(offer, info)

        mdns = MDNSDiscovery(
            self._host.libp2p.get_network(), port=port, listen_addrs=addrs, ttl=MDNS_TTL_S
        )
        peerDiscovery.register_peer_discovered_handler(heard)
        try:
            # WORKAROUND(mdns-task): start() runs its cleanup loop as a trio *system* task;
            # stop() below cancels it, so it never outlives this service.
            mdns.start()
            logger.info("mDNS: announcing %s on the local network", ", ".join(addrs))
            task_status.started()
            async with trio.open_nursery() as nursery, receive:
                async for info in receive:
                    if info.peer_id != self._host.peer_id and not self._host.is_connected(
                        info.peer_id
                    ):
                        self.found += 1
                        nursery.start_soon(self._dial, info)
        finally:
            peerDiscovery.unregister_peer_discovered_handler(heard)
            send.close()
            mdns.stop()  # cancels its system task: must run in the trio thread

    async def _dial(self, info: PeerInfo) -> None:
        try:
            await self._host.connect(info)
        except PeerUnreachable as exc:
            logger.debug("mDNS peer %s: %s", info.peer_id, exc)
            return
        self.connected += 1
        logger.info("mDNS: connected to %s on the local network", info.peer_id)
        self._on_connect()
