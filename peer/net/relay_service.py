"""Reachability checks and relays: the trio shell around peer/net/reachability.py.

/prefixswarm/dialback/1.0.0 (an AutoNAT equivalent) asks peers to dial us back at the
IP they see; /prefixswarm/relay/1.0.0 lets a private peer reserve slots on reachable
peers (their side: peer/net/relay_server.py) and an entry peer reach it through one.
Nothing above the host knows whether a stream is relayed: SwarmHost.new_stream falls
back to `Reach.open_relayed`. Wire format and bounds: docs/protocol.md.
"""

from __future__ import annotations

import functools
import logging
import random
import socket
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import multiaddr
import trio
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.transport.tcp.tcp import TCP

from peer.net.reachability import (
    MAX_DIALBACK_PORTS,
    CheckSchedule,
    DialBackRequest,
    DialBackResponse,
    Reachability,
    ReachabilityTracker,
    RelayConnect,
    RelayLimits,
    RelayReply,
    RelayReserve,
    circuit_addr,
    expand_unspecified,
    is_circuit,
    relay_of,
)
from peer.net.relay_channel import (
    RelayAuthError,
    accept_circuit,
    secure_outbound,
)
from peer.net.relay_server import (
    CONTROL_TIMEOUT_S,
    RELAY_PROTOCOL,
    RELAY_STOP_PROTOCOL,
    RelayServer,
    close_stream,
    read_control,
)
from protocols.errors import RemoteProtocolError

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/prefixswarm/dialback/1.0.0"

DIALBACK_DIAL_TIMEOUT_S = 3.0  # a fresh TCP connect + one multistream header, per port
DIALBACK_CONCURRENCY = 4  # dial-backs we run for others at once
CHECK_FIRST_S = 1.0  # first reachability check this soon after a connection exists
CHECK_UNKNOWN_S = 5.0  # ...again this soon while the verdict is unknown (doubling while
#   no peer that was never asked is connected: CheckSchedule)
CHECK_INTERVAL_S = 120.0  # ...and this often once known (a router may change)
CHECK_FANOUT = 3  # peers asked per check
RESERVE_RELAYS = 2  # relays a private peer keeps a reservation on
RESERVE_RETRY_S = 2.0  # look for relays this often while we hold fewer than RESERVE_RELAYS
DIRECT_FAILURE_MEMORY_S = 60.0  # after a failed direct dial, go through a relay this long
RELAY_CANDIDATES = 4  # relays tried per relayed stream (hints first, then connected peers)
BAD_RELAY_S = 600.0  # a relay that failed a handshake or changed a message is not used this long
MAX_BAD_RELAYS = 1024


def interface_ips() -> list[str]:
    """IPv4 addresses of this machine's interfaces (Linux; loopback if nothing else)."""
    import fcntl
    import struct

    ips: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode())  # SIOCGIFADDR
                )
            except OSError:
                continue  # an interface without an IPv4 address
            ips.append(socket.inet_ntoa(packed[20:24]))
    return ips or ["127.0.0.1"]


def peer_addrs(libp2p: Any, peer_id: ID) -> list[str]:
    """The addresses the peerstore holds for a peer ([] for a peer it never heard of)."""
    try:
        return [str(a) for a in libp2p.get_peerstore().addrs(peer_id)]
    except PeerStoreError:
        return []


class Reach:
    """This peer's reachability, its relay service and its reservations on relays."""

    def __init__(
        self,
        host: Any,  # peer.net.host.SwarmHost (not imported: host imports us)
        *,
        listen_ports: Sequence[int],
        announce: Sequence[str],
        relay_service: bool,
        use_relays: bool,
        limits: RelayLimits | None = None,
        rng: random.Random | None = None,
        on_change: Callable[[Reachability], None] = lambda verdict: None,
    ) -> None:
        self._host = host
        self._ports = tuple(sorted(set(listen_ports)))[:MAX_DIALBACK_PORTS]
        self._announce = tuple(announce)
        self.relay_service = relay_service
        self.use_relays = use_relays
        self.limits = limits or RelayLimits()
        self._rng = rng or random.Random()
        self._on_change = on_change
        self.tracker = ReachabilityTracker(listen_ports=len(self._ports))
        self._my_relays: dict[str, tuple[str, float]] = {}  # relay id -> (its addr, expiry)
        self._direct_failed: dict[str, float] = {}  # peer id -> when a direct dial failed
        self._bad_relays: dict[str, float] = {}  # relay id -> when it failed us end to end
        # relay id -> until when circuits through it are ours to serve: a reservation's
        # expiry plus a TTL (the relay may still hold it after we dropped it at half-life)
        self._circuits_from: dict[str, float] = {}
        self._dialbacks = trio.Semaphore(DIALBACK_CONCURRENCY)
        self._verdict = self.tracker.verdict(0.0)
        self.stats: Counter[str] = Counter()
        self._relay = RelayServer(host, self.limits, self.stats, self._refusal)
        self.on_addrs_changed: Callable[[], None] = lambda: None  # e.g. re-provide

    # -- state -------------------------------------------------------------------------

    def verdict(self) -> Reachability:
        return self.tracker.verdict(trio.current_time())

    def relayed_addrs(self) -> list[str]:
        now = trio.current_time()
        me = self._host.peer_id.to_base58()
        return [circuit_addr(addr, me) for addr, expiry in self._my_relays.values() if now < expiry]

    def advertised(self, candidates: Sequence[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """libp2p's addrs_factory: only addresses others can dial (without /p2p/<us>).

        --announce always; then by verdict: PUBLIC -> the addresses peers reached us at;
        PRIVATE -> our relayed addresses; UNKNOWN -> the listen addresses with 0.0.0.0
        expanded to the interface addresses (good on a LAN; checked soon)."""
        now = trio.current_time()
        out: list[str] = list(self._announce)
        verdict = self.tracker.verdict(now)
        if verdict is Reachability.PUBLIC:
            out += self.tracker.confirmed_addrs(now)
        elif verdict is Reachability.PRIVATE:
            out += self.relayed_addrs()
        else:
            ips = interface_ips()
            for addr in candidates:
                out += expand_unspecified(str(addr), ips)
        unique = list(dict.fromkeys(out))
        return [multiaddr.Multiaddr(a) for a in unique]

    def statistics(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "reachability": self.tracker.verdict(now).value,
            "evidence": self.tracker.evidence(now),
            "relay_service": self.relay_service,
            "reservations_held_for_others": self._relay.reservations_held(now),
            "circuits_open": self._relay.circuits_open(),
            "relays": sorted(self._my_relays),
            **dict(self.stats),
        }

    # -- service -------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        libp2p = self._host.libp2p
        async with trio.open_nursery() as nursery:
            libp2p.set_stream_handler(TProtocol(DIALBACK_PROTOCOL), self._handle_dialback)
            libp2p.set_stream_handler(TProtocol(RELAY_PROTOCOL), self._relay.handle)
            libp2p.set_stream_handler(TProtocol(RELAY_STOP_PROTOCOL), self._handle_circuit)
            self._nursery = nursery
            nursery.start_soon(self._check_loop)
            if self.use_relays:
                nursery.start_soon(self._reserve_loop)
            task_status.started()

    def _note_verdict(self) -> None:
        verdict = self.verdict()
        if verdict is not self._verdict:
            self._verdict = verdict
            self._on_change(verdict)
            self.on_addrs_changed()

    # -- reachability checks (client) -------------------------------------------------

    async def _check_loop(self) -> None:
        await trio.sleep(CHECK_FIRST_S)
        self._note_verdict()  # an outbound-only peer is PRIVATE from the start
        schedule: CheckSchedule[ID] = CheckSchedule(CHECK_FANOUT)
        while True:
            peers = self._host.connected_peers()
            if self._ports and peers:
                async with trio.open_nursery() as nursery:
                    for peer_id in schedule.choose(peers, self._rng):
                        nursery.start_soon(self._ask_dialback, peer_id)
                self._note_verdict()
            known = self._verdict is not Reachability.UNKNOWN
            await trio.sleep(CHECK_INTERVAL_S if known
                             else schedule.unknown_delay(CHECK_UNKNOWN_S, CHECK_INTERVAL_S)
                             if peers else 1.0)

    async def _ask_dialback(self, peer_id: ID) -> None:
        request = DialBackRequest(self._ports)
        self.stats["dialbacks_asked"] += 1
        try:
            stream = await self._host.new_stream(
                peer_id, [DIALBACK_PROTOCOL], timeout_s=CONTROL_TIMEOUT_S, relay=False
            )
        except Exception as exc:  # the peer is gone or does not speak the protocol
            logger.debug("dial-back request to %s: %s", peer_id, exc)
            return
        remote = stream.get_remote_address()  # the reporter's own IP: its network is its vote
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S + DIALBACK_DIAL_TIMEOUT_S * len(self._ports)):
                await stream.write(request.encode())
                response = DialBackResponse.parse(await read_control(stream), request)
        except (trio.TooSlowError, RemoteProtocolError, Exception) as exc:
            logger.debug("dial-back answer from %s: %s", peer_id, exc)
            return
        finally:
            await close_stream(stream)
        now = trio.current_time()
        ok = bool(response.ok_ports)
        port = response.ok_ports[0] if ok else self._ports[0]
        family = "ip6" if ":" in response.observed_ip else "ip4"
        addr = f"/{family}/{response.observed_ip}/tcp/{port}"
        self.tracker.record(peer_id.to_base58(), ok=ok, addr=addr, now=now,
                            reporter_ip=remote[0] if remote else "")
        self.stats["dialbacks_ok" if ok else "dialbacks_failed"] += 1

    # -- reachability checks (server) -------------------------------------------------

    async def _handle_dialback(self, stream: Any) -> None:
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S):
                request = DialBackRequest.parse(await read_control(stream))
            remote = stream.get_remote_address()
            if remote is None:
                raise RemoteProtocolError("no remote address (a relayed stream)")
            ip = remote[0]
            asker = stream.muxed_conn.peer_id
            async with self._dialbacks:
                ok = [port for port in request.ports
                      if await _dial_back(self._host.libp2p, ip, port, asker)]
            self.stats["dialbacks_served"] += 1
            with trio.fail_after(CONTROL_TIMEOUT_S):
                await stream.write(DialBackResponse(ip, tuple(ok)).encode())
        except Exception as exc:  # bad request or a peer that left: it keeps serving
            logger.debug("dial-back for a peer: %s", exc)
        finally:
            await close_stream(stream)

    def _refusal(self) -> str | None:
        if not self.relay_service:
            return "this peer does not relay (--no-relay-service)"
        if self.verdict() is Reachability.PRIVATE:
            return "this peer is not publicly reachable"
        return None

    # -- reservations (a private peer) ------------------------------------------------

    async def _reserve_loop(self) -> None:
        while True:
            now = trio.current_time()
            for relay, (_addr, expiry) in list(self._my_relays.items()):
                if now >= expiry - self.limits.reservation_ttl_s / 2 or not self._host.is_connected(
                    ID.from_base58(relay)
                ):
                    del self._my_relays[relay]
                    self.on_addrs_changed()
            if self.verdict() is Reachability.PRIVATE and len(self._my_relays) < RESERVE_RELAYS:
                peers = [p for p in self._host.connected_peers() if p.to_base58() not in
                         self._my_relays]
                self._rng.shuffle(peers)
                for peer_id in peers[: RESERVE_RELAYS - len(self._my_relays)]:
                    await self._reserve(peer_id)
            await trio.sleep(RESERVE_RETRY_S)

    async def _reserve(self, relay: ID) -> None:
        addrs = [a.split("/p2p/")[0] for a in peer_addrs(self._host.libp2p, relay)
                 if not is_circuit(a)]
        if not addrs:
            return
        try:
            stream = await self._host.new_stream(
                relay, [RELAY_PROTOCOL], timeout_s=CONTROL_TIMEOUT_S, relay=False
            )
        except Exception as exc:  # not a relay (older peer) or gone
            logger.debug("reserve on %s: %s", relay, exc)
            return
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S):
                await stream.write(RelayReserve().encode())
                reply = RelayReply.parse(await read_control(stream))
        except Exception as exc:  # slow, malformed or gone
            logger.debug("reserve on %s: %s", relay, exc)
            return
        finally:
            await close_stream(stream)
        if not reply.ok:
            self.stats["reservations_refused_to_us"] += 1
            logger.debug("relay %s refused a reservation: %s", relay, reply.error)
            return
        addr = f"{addrs[0]}/p2p/{relay.to_base58()}"
        previous = set(self._my_relays)
        self._my_relays[relay.to_base58()] = (addr, trio.current_time() + reply.ttl_s)
        if len(self._circuits_from) >= MAX_BAD_RELAYS:
            self._circuits_from.clear()  # refilled by the next refreshes
        self._circuits_from[relay.to_base58()] = trio.current_time() + 2 * reply.ttl_s
        self.stats["reservations_made"] += 1
        if relay.to_base58() not in previous:
            self.on_addrs_changed()
        logger.info("reserved a relay slot on %s: reachable as %s", relay,
                    circuit_addr(addr, self._host.peer_id.to_base58()))

    # -- relayed streams (an entry peer) -------------------------------------------

    def prefer_relay(self, peer_id: ID) -> bool:
        """Whether to skip a direct dial: only relayed addresses known, or one failed."""
        key = peer_id.to_base58()
        failed = self._direct_failed.get(key)
        if failed is not None and trio.current_time() - failed < DIRECT_FAILURE_MEMORY_S:
            return True
        addrs = peer_addrs(self._host.libp2p, peer_id)
        return bool(addrs) and all(is_circuit(a) for a in addrs)

    def note_direct_failure(self, peer_id: ID) -> None:
        if len(self._direct_failed) > 4096:
            self._direct_failed.clear()
        self._direct_failed[peer_id.to_base58()] = trio.current_time()

    def set_reservation_filter(self, excluded: Callable[[str], bool]) -> None:
        """Peers refused a reservation on us whatever the book says (e.g. quarantined)."""
        self._relay.excluded = excluded

    def _identity(self) -> KeyPair:
        libp2p = self._host.libp2p
        return KeyPair(libp2p.get_private_key(), libp2p.get_public_key())

    def note_bad_relay(self, relay: str) -> None:
        """A relay failed an end-to-end handshake or changed a message: avoid it."""
        if len(self._bad_relays) >= MAX_BAD_RELAYS:
            self._bad_relays.clear()
        self._bad_relays[relay] = trio.current_time()
        self.stats["relays_avoided"] += 1

    def _is_bad_relay(self, relay: str) -> bool:
        at = self._bad_relays.get(relay)
        return at is not None and trio.current_time() - at < BAD_RELAY_S

    async def _handle_circuit(self, stream: Any) -> None:
        """A circuit a relay brings us: served only from a relay we hold a slot on."""
        mux = self._host.libp2p.get_mux()
        await accept_circuit(
            stream,
            self._identity(),
            relay_allowed=lambda relay: trio.current_time() < self._circuits_from.get(relay, 0.0),
            handler_for=lambda protocol: mux.handlers.get(TProtocol(protocol)),
            stats=self.stats,
        )

    def relay_candidates(self, peer_id: ID) -> list[ID]:
        hints = []
        for addr in peer_addrs(self._host.libp2p, peer_id):
            relay = relay_of(addr)
            if relay is not None:
                hints.append(relay)
        others = [p.to_base58() for p in self._host.connected_peers() if p != peer_id]
        self._rng.shuffle(others)
        ordered = [r for r in dict.fromkeys([*hints, *others]) if not self._is_bad_relay(r)]
        ordered = ordered[:RELAY_CANDIDATES]
        return [ID.from_base58(r) for r in ordered]

    async def open_relayed(self, peer_id: ID, protocol: str, *, timeout_s: float) -> Any:
        """A stream to `peer_id` speaking `protocol` through a relay, end to end encrypted
        and proven to reach `peer_id` (peer/net/relay_channel.py); raises LookupError."""
        errors: list[str] = []
        with trio.move_on_after(timeout_s):
            for relay in self.relay_candidates(peer_id):
                try:
                    stream = await self._host.new_stream(
                        relay, [RELAY_PROTOCOL], timeout_s=CONTROL_TIMEOUT_S, relay=False
                    )
                except Exception as exc:  # that relay is gone: try the next
                    errors.append(f"{relay}: {exc}")
                    continue
                try:
                    with trio.fail_after(CONTROL_TIMEOUT_S):
                        await stream.write(RelayConnect(peer_id.to_base58(), protocol).encode())
                        reply = RelayReply.parse(await read_control(stream))
                except Exception as exc:  # slow, malformed or gone
                    errors.append(f"{relay}: {exc}")
                    await close_stream(stream)
                    continue
                if not reply.ok:
                    errors.append(f"{relay}: {reply.error}")
                    await close_stream(stream)
                    continue
                try:
                    secured = await secure_outbound(stream, self._identity(), peer_id, protocol)
                except RelayAuthError as exc:  # answered as someone else, meddled, or ended
                    errors.append(f"{relay}: {exc}")
                    self.stats["relayed_handshakes_failed"] += 1
                    if exc.meddled:
                        self.note_bad_relay(relay.to_base58())
                    await close_stream(stream)
                    continue
                secured.on_tampered = functools.partial(self.note_bad_relay, relay.to_base58())
                self.stats["relayed_streams"] += 1
                return secured
        self.stats["relayed_stream_failures"] += 1
        raise LookupError("; ".join(errors) or "no relay to try")


async def _dial_back(libp2p: Any, ip: str, port: int, expected: ID) -> bool:
    """Whether the peer `expected` answers a fresh connection at ip:port.

    A fresh TCP connection and a Noise handshake that proves the listener's identity
    (a bare TCP connect could reach someone else behind the same IP: another peer on a
    shared address, a NAT forwarding that port elsewhere). Closed at once."""
    family = "ip6" if ":" in ip else "ip4"
    with trio.move_on_after(DIALBACK_DIAL_TIMEOUT_S):
        try:
            raw = await TCP().dial(multiaddr.Multiaddr(f"/{family}/{ip}/tcp/{port}"))
        except Exception as exc:  # refused, unreachable, bad address: not dialable there
            logger.debug("dial-back to %s:%d: %r", ip, port, exc)
            return False
        try:
            upgrader = libp2p.get_network().upgrader
            secured = await upgrader.upgrade_security(raw, True, expected)
            return bool(secured.get_remote_peer() == expected)
        except Exception as exc:  # wrong peer, or whatever a stranger answers a handshake with
            logger.debug("dial-back handshake with %s:%d: %r", ip, port, exc)
            return False
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await raw.close()
                except Exception as exc:  # already closed by the other side
                    logger.debug("closing dial-back connection: %s", exc)
    return False
