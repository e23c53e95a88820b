"""The libp2p host: persisted ed25519 identity, Noise, yamux, TCP listen; a small wrapper.

With peer/net/libp2p_fixes.py (the process-wide fixes `open_host` applies) and
peer/net/host_services.py (the DHT and GossipSub on the host), the only modules that know
py-libp2p internals: each workaround for a py-libp2p 0.8.1 problem is in the three,
marked `WORKAROUND(n)` with n the number in docs/libp2p.md (or a name).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair as create_ed25519_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.identity_utils import load_identity, save_identity
from libp2p.io.utils import read_exactly
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from peer.config import PeerConfig
from peer.net import libp2p_fixes
from peer.net.lazy_select import LazyStream, proposal_bytes
from peer.net.punch_service import HolePunch
from peer.net.reachability import Reachability, is_circuit
from peer.net.relay_server import RELAYABLE
from peer.net.relay_service import Reach
from peer.net.wire import PeerUnreachable, reset_quietly

logger = logging.getLogger(__name__)


# Deadlines for remote calls, each with its reason.
CONNECT_TIMEOUT_S = 5.0  # a loopback/LAN dial takes ~10 ms; a WAN dial + Noise < 1 s
STREAM_TIMEOUT_S = 5.0  # negotiating a protocol on a live connection is one round trip
PING_TIMEOUT_S = 3.0  # a live peer answers 32 bytes in well under a second
CLOSE_TIMEOUT_S = 5.0  # closing is local work plus best-effort goodbyes; never hang on it
PEERSTORE_ADDR_TTL_S = 600  # addresses we dialled stay known for re-dials after a blip
PING_LENGTH = 32  # fixed by the /ipfs/ping/1.0.0 protocol
RELAYED_FRESH_S = 60.0  # a peer reached through a relay counts as reachable this long
MAX_RELAYED_REMEMBERED = 4096  # peers remembered as relayed: far more than a swarm's


class HostError(Exception):
    """The local host could not do what was asked (listen, load identity)."""


def load_or_create_identity(path: Path | None) -> KeyPair:
    """The peer's ed25519 key pair: loaded from `path`, created there (mode 0600) on
    first start, or ephemeral when `path` is None."""
    if path is None:
        return create_ed25519_key_pair()
    path = Path(os.path.expanduser(path))
    if path.exists():
        try:
            key_pair = load_identity(path)
        except (ValueError, OSError) as exc:
            raise HostError(f"cannot load identity key file {path}: {exc}") from exc
        if key_pair.private_key.get_type() != KeyType.Ed25519:
            raise HostError(f"identity key file {path} holds a non-ed25519 key")
        return key_pair
    key_pair = create_ed25519_key_pair()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a private temporary name, then rename: a crash never leaves half a key.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        save_identity(key_pair, tmp)  # creates with mode 0600
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("created identity key file %s", path)
    return key_pair


def parse_peer_addr(addr: str | multiaddr.Multiaddr) -> PeerInfo:
    """`/ip4/.../tcp/.../p2p/<id>` -> PeerInfo; ValueError when it is not one."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(str(addr)))
    except Exception as exc:  # multiaddr raises a zoo of types for bad input
        raise ValueError(f"not a peer multiaddr with /p2p/<id>: {addr!r} ({exc})") from exc


class SwarmHost:
    """A running libp2p host. Remote calls take a deadline and raise PeerUnreachable."""

    def __init__(self, host: IHost, listen_addrs: Sequence[multiaddr.Multiaddr]) -> None:
        self.libp2p = host  # the raw py-libp2p host, for services built on it
        self._listen_addrs = tuple(listen_addrs)
        self.reach: Reach | None = None  # reachability and relays (open_host sets it)
        self.holepunch: HolePunch | None = None  # relayed -> direct upgrades (open_host)
        self._relayed_ok: dict[ID, float] = {}  # peers reached through a relay, and when

    @property
    def peer_id(self) -> ID:
        return self.libp2p.get_id()

    @property
    def multiaddrs(self) -> list[str]:
        """Addresses other peers can dial, each ending in /p2p/<peer id>."""
        return [str(a) for a in self.libp2p.get_addrs()]

    def connected_peers(self) -> list[ID]:
        return list(self.libp2p.get_connected_peers())

    def is_connected(self, peer_id: ID) -> bool:
        return bool(self.libp2p.get_network().get_connections(peer_id))

    def is_relayed(self, peer_id: ID) -> bool:
        """Reached through a relay within the last RELAYED_FRESH_S (no direct connection)."""
        at = self._relayed_ok.get(peer_id)
        return at is not None and trio.current_time() - at < RELAYED_FRESH_S

    def may_relay_to(self, peer_id: ID) -> bool:
        """Not connected, but a relay may reach it (a peer behind NAT that reserved relay
        slots). Liveness pings such members through a relay, so the router measures their
        round trip like any other peer's; one that never answers is pinged ever more
        rarely (discovery backs off)."""
        if self.reach is None or self.is_connected(peer_id):
            return False
        return bool(self.reach.relay_candidates(peer_id))

    def reachability(self) -> Reachability:
        return self.reach.verdict() if self.reach is not None else Reachability.UNKNOWN

    async def connect(
        self, addr: str | multiaddr.Multiaddr | PeerInfo, *, timeout_s: float = CONNECT_TIMEOUT_S
    ) -> ID:
        """Dial a peer (no-op when already connected); returns its peer id."""
        info = addr if isinstance(addr, PeerInfo) else parse_peer_addr(addr)
        if info.peer_id == self.peer_id:
            raise ValueError("refusing to dial ourselves")
        if (
            self.reach is not None
            and not self.is_connected(info.peer_id)
            and all(is_circuit(str(a)) for a in info.addrs)
        ):
            # Only relayed addresses, or none (a peer behind NAT): libp2p has no
            # transport for them (ours is an application-level relay); remember them
            # and prove the peer answers through a relay.
            if info.addrs:
                self.libp2p.get_peerstore().clear_addrs(info.peer_id)
                self.libp2p.get_peerstore().add_addrs(
                    info.peer_id, info.addrs, PEERSTORE_ADDR_TTL_S
                )
            await self.ping(info.peer_id, timeout_s=timeout_s)
            return info.peer_id
        # WORKAROUND(5): after all addresses of a peer failed once, dials to it are
        # refused for 60 s from a negative cache, even after it restarted. An explicit
        # connect means we have reason to believe it is back: clear the entry.
        self.libp2p.get_network().unblock_peer(info.peer_id)  # type: ignore[attr-defined]
        if info.addrs and not self.is_connected(info.peer_id):
            # WORKAROUND(addrs): a dial tries only ONE TCP address per peer, the first
            # in the peerstore (swarm.dial_peer keeps one address per transport class),
            # so a peer restarted on another port stays unreachable while its old
            # address is remembered. Dial exactly the addresses we were given.
            self.libp2p.get_peerstore().clear_addrs(info.peer_id)
        try:
            await self._direct_connect(info, timeout_s)
        except PeerUnreachable:
            if self.reach is None:
                raise
            # Not dialable (behind NAT, private address): reachable through a relay?
            self.reach.note_direct_failure(info.peer_id)
            await self.ping(info.peer_id, timeout_s=timeout_s)
        return info.peer_id

    async def _direct_connect(self, info: PeerInfo, timeout_s: float) -> None:
        try:
            with trio.fail_after(timeout_s):
                await self.libp2p.connect(info)
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"dial {info.peer_id} timed out after {timeout_s} s") from exc
        except Exception as exc:  # libp2p raises many unrelated types on dial
            raise PeerUnreachable(f"dial {info.peer_id} failed: {exc}") from exc
        self.libp2p.get_peerstore().add_addrs(info.peer_id, info.addrs, PEERSTORE_ADDR_TTL_S)

    async def disconnect(self, peer_id: ID) -> None:
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await self.libp2p.disconnect(peer_id)

    async def new_stream(
        self,
        peer_id: ID,
        protocols: Sequence[str],
        *,
        timeout_s: float = STREAM_TIMEOUT_S,
        relay: bool = True,
        lazy: bool = False,
    ) -> INetStream:
        """Open a stream speaking one of `protocols` (dials if needed).

        A peer we hold no connection to and cannot dial (behind NAT) is reached through
        a relay it reserved a slot on, for the protocols relays carry (`relay=False`:
        direct only). `lazy`, one protocol, a connection held: the stream is returned
        before the peer has accepted the protocol, so its first message goes with the
        proposal (peer/net/lazy_select.py); a refusal shows on its first read."""
        if lazy and len(protocols) == 1 and self.is_connected(peer_id):
            return await self._lazy_stream(peer_id, TProtocol(protocols[0]), timeout_s)
        reach = self.reach if relay else None
        relayable = [p for p in protocols if p in RELAYABLE]
        if reach is not None and relayable and not self.is_connected(peer_id):
            deadline = trio.current_time() + timeout_s
            if not reach.prefer_relay(peer_id):
                try:
                    return await self._direct_stream(peer_id, protocols, timeout_s / 2)
                except PeerUnreachable as exc:
                    logger.debug("direct stream failed, trying relays: %s", exc)
                    reach.note_direct_failure(peer_id)
            try:
                stream = await reach.open_relayed(
                    peer_id, relayable[0], timeout_s=max(0.0, deadline - trio.current_time())
                )
            except LookupError as exc:
                raise PeerUnreachable(
                    f"stream to {peer_id}: no direct or relayed route ({exc})"
                ) from exc
            if len(self._relayed_ok) >= MAX_RELAYED_REMEMBERED:
                self._relayed_ok.clear()  # rebuilt by the next relayed streams
            self._relayed_ok[peer_id] = trio.current_time()
            if self.holepunch is not None:
                self.holepunch.note_relayed(peer_id)  # in the background, within its budget
            return stream  # type: ignore[no-any-return]
        return await self._direct_stream(peer_id, protocols, timeout_s)

    async def _lazy_stream(
        self, peer_id: ID, protocol: TProtocol, timeout_s: float
    ) -> INetStream:
        deadline = trio.current_time() + timeout_s  # one deadline for the open and the write
        try:
            with trio.fail_at(deadline):
                stream = await self.libp2p.get_network().new_stream(peer_id)
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"stream to {peer_id} timed out after {timeout_s} s") from exc
        except Exception as exc:  # muxer errors have no common base
            raise PeerUnreachable(f"stream to {peer_id} failed: {exc}") from exc
        try:
            with trio.fail_at(deadline):
                await stream.write(proposal_bytes(protocol))
        except BaseException as exc:  # cancelled (a hedge won) included: never leak it
            await reset_quietly(stream)  # shielded
            if isinstance(exc, (trio.TooSlowError, BaseLibp2pError)):
                raise PeerUnreachable(f"stream to {peer_id} failed: {exc!r}") from exc
            raise
        stream.set_protocol(protocol)
        return LazyStream(stream, protocol)  # type: ignore[return-value]  # what callers use

    async def _direct_stream(
        self, peer_id: ID, protocols: Sequence[str], timeout_s: float
    ) -> INetStream:
        try:
            with trio.fail_after(timeout_s):
                return await self.libp2p.new_stream(peer_id, [TProtocol(p) for p in protocols])
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"stream to {peer_id} timed out after {timeout_s} s") from exc
        except Exception as exc:  # dial, negotiation and muxer errors have no common base
            raise PeerUnreachable(f"stream to {peer_id} failed: {exc}") from exc

    async def ping(self, peer_id: ID, *, timeout_s: float = PING_TIMEOUT_S) -> float:
        """One /ipfs/ping/1.0.0 round trip on a fresh stream; returns seconds.

        (libp2p's PingService rounds to whole milliseconds: 0 on loopback.)"""
        stream = await self.new_stream(peer_id, [PING_PROTOCOL_ID], timeout_s=timeout_s)
        payload = secrets.token_bytes(PING_LENGTH)
        try:
            with trio.fail_after(timeout_s):
                start = trio.current_time()
                await stream.write(payload)
                echo = await read_exactly(stream, PING_LENGTH)
                rtt = trio.current_time() - start
        except trio.TooSlowError as exc:
            raise PeerUnreachable(f"ping {peer_id} timed out after {timeout_s} s") from exc
        except Exception as exc:  # stream reset/EOF types vary by muxer
            raise PeerUnreachable(f"ping {peer_id} failed: {exc}") from exc
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S):
                await _close_quietly(stream)
        if echo != payload:
            raise PeerUnreachable(f"ping {peer_id}: echo does not match")
        return rtt


async def _close_quietly(stream: INetStream) -> None:
    try:
        await stream.close()
    except Exception as exc:  # a stream already reset by the peer cannot be closed
        logger.debug("closing stream: %s", exc)


def _build_host(
    config: PeerConfig,
    key_pair: KeyPair,
    advertised: Callable[[Sequence[multiaddr.Multiaddr]], list[multiaddr.Multiaddr]],
) -> tuple[IHost, list[multiaddr.Multiaddr]]:
    listen = [multiaddr.Multiaddr(a) for a in config.listen_addrs]
    # Pass sec_opt explicitly: the default also offers /plaintext/2.0.0.
    sec_opt = {
        NOISE_PROTOCOL_ID: NoiseTransport(
            key_pair, noise_privkey=create_x25519_key_pair().private_key
        )
    }
    host = new_host(
        key_pair=key_pair,
        sec_opt=sec_opt,
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=listen,
    )
    # What we advertise (identify, DHT provider records): only dialable addresses,
    # decided by Reach (announced, confirmed by dial-backs, relayed; never 0.0.0.0).
    # WORKAROUND(circuit-addrs): BasicHost.get_addrs passes addrs_factory's output
    # through a /p2p/ rewrite that cuts a relayed address at its FIRST /p2p/ (the
    # relay's id), turning "/ip4/R/tcp/P/p2p/R/p2p-circuit" into R's own address with
    # our id. Replace get_addrs on this host instead.
    suffix = f"/p2p/{host.get_id()!s}"

    def get_addrs() -> list[multiaddr.Multiaddr]:
        return [
            multiaddr.Multiaddr(str(a) if str(a).endswith(suffix) else str(a) + suffix)
            for a in advertised(host.get_transport_addrs())
        ]

    host.get_addrs = get_addrs  # type: ignore[method-assign]
    return host, listen


def _tcp_ports(addrs: Sequence[str]) -> list[int]:
    ports = []
    for addr in addrs:
        parts = addr.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            port = parts[parts.index("tcp") + 1]
            if port.isdigit() and int(port):
                ports.append(int(port))
    return ports


@asynccontextmanager
async def open_host(config: PeerConfig) -> AsyncIterator[SwarmHost]:
    """Start a host listening on config.listen_addrs; closed (sockets and all) on exit."""
    libp2p_fixes.apply()  # process-wide and idempotent; each fix checks its target first
    key_pair = load_or_create_identity(config.identity_file)
    reach: Reach | None = None

    def advertised(candidates: Sequence[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        return list(candidates) if reach is None else reach.advertised(candidates)

    host, listen = _build_host(config, key_pair, advertised)
    failed: HostError | None = None
    mapped_port: int | None = None  # a UPnP mapping to remove on the way out
    async with host.run(listen_addrs=listen):
        try:
            # WORKAROUND(listen): host.run ignores addresses it could not listen on
            # (port in use, bad interface); fail loudly instead. (Raised after leaving
            # host.run so the caller gets a HostError, not an exception group.)
            bound = set(host.get_network().listeners)
            missing = [str(a) for a in listen if str(a) not in bound]
            if missing:
                failed = HostError(f"could not listen on {', '.join(missing)}")
            else:
                swarm_host = SwarmHost(host, listen)
                # Port 0 listens on a port the OS picks: ask the listeners which.
                bound_addrs = [str(a) for a in host.get_transport_addrs()]
                ports = _tcp_ports(bound_addrs)
                announce = list(config.announce_addrs)
                if config.upnp and ports:
                    from peer.net.upnp import map_port

                    mapped = await trio.to_thread.run_sync(map_port, ports[0])
                    if mapped is not None:
                        announce.append(mapped)
                        mapped_port = ports[0]
                reach = Reach(
                    swarm_host,
                    listen_ports=ports,
                    announce=announce,
                    relay_service=config.relay_service,
                    use_relays=config.use_relays,
                    on_change=_say_reachability,
                )
                swarm_host.reach = reach
                swarm_host.holepunch = HolePunch(swarm_host, listen_addrs=bound_addrs)
                yield swarm_host
        finally:
            # WORKAROUND(3): leaving host.run by cancellation leaks the listening
            # socket and outbound connections (peers keep a zombie connection).
            # Close explicitly, shielded so a cancelled caller still cleans up.
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
                await host.close()
            if scope.cancelled_caught:
                logger.warning("host close took over %s s; abandoned", CLOSE_TIMEOUT_S)
            if mapped_port is not None:
                from peer.net.upnp import unmap_port

                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                    await trio.to_thread.run_sync(unmap_port, mapped_port)
    if failed is not None:
        raise failed


def _say_reachability(verdict: Reachability) -> None:
    if verdict is Reachability.PUBLIC:
        logger.warning("reachability: public (other peers can dial this peer)")
    elif verdict is Reachability.PRIVATE:
        logger.warning(
            "reachability: NOT publicly dialable (behind NAT or a firewall, or no listen "
            "address): serving through relays; forward a port and pass --announce to be "
            "dialled directly (docs/joining.md)"
        )


# -- measurement -------------------------------------------------------------------------


class WireBytes:
    """Bytes this process sent and received on libp2p TCP connections (all protocols,
    after Noise encryption and yamux framing: what crosses the network)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0


_wire_bytes: WireBytes | None = None


def count_wire_bytes() -> WireBytes:
    """Start counting TCP bytes process-wide (idempotent); returns the live counters.

    Wraps py-libp2p's TrioTCPStream read/write: there is no public byte counter."""
    global _wire_bytes
    if _wire_bytes is not None:
        return _wire_bytes
    from libp2p.io.trio import TrioTCPStream

    counters = WireBytes()
    original_write, original_read = TrioTCPStream.write, TrioTCPStream.read

    async def write(self: TrioTCPStream, data: bytes) -> None:
        counters.sent += len(data)
        await original_write(self, data)

    async def read(self: TrioTCPStream, n: int | None = None) -> bytes:
        data = await original_read(self, n)
        counters.received += len(data)
        return data

    TrioTCPStream.write = write  # type: ignore[method-assign]
    TrioTCPStream.read = read  # type: ignore[method-assign]
    _wire_bytes = counters
    return counters
