"""Where peers are seen: the /prefixswarm/observed/1.0.0 protocol and our own networks.

A hole punch dials only where the other side was observed (peer/net/punch_policy.py).
Across a relay we never saw it; the relay did: it holds an authenticated connection to
each end of the circuit. `ask_observed` asks the relay carrying a punch for the IPs of
its connections to the other side; `serve_observed` answers such questions about peers
we are connected to (IPs only, at most MAX_OBSERVED_IPS: what any peer the other side
connects to sees anyway). `interface_networks` says which LAN is ours.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

import trio
from libp2p.io.utils import read_exactly
from libp2p.peer.id import ID

from peer.net.punch import (
    CONTROL_FRAME_BYTES,
    MAX_OBSERVED_IPS,
    ObservedAnswer,
    ObservedQuery,
    parse_observed_answer,
    parse_observed_query,
)
from peer.net.punch_policy import IPNetwork
from protocols.errors import RemoteProtocolError
from protocols.framing import FRAME_HEADER_BYTES, decode_cbor

logger = logging.getLogger(__name__)

OBSERVED_PROTOCOL = "/prefixswarm/observed/1.0.0"
OBSERVED_TIMEOUT_S = 5.0  # one question and its answer on a live connection


async def read_control(stream: Any) -> object:
    """One length-prefixed control frame (at most punch.CONTROL_FRAME_BYTES), decoded."""
    header = await read_exactly(stream, FRAME_HEADER_BYTES)
    length = int.from_bytes(header, "big")
    if not 1 <= length <= CONTROL_FRAME_BYTES:
        raise RemoteProtocolError(f"control frame of {length} bytes (limit {CONTROL_FRAME_BYTES})")
    return decode_cbor(await read_exactly(stream, length))


async def close_quietly(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.close()
        except Exception as exc:  # reset, EOF, closed: muxers vary
            logger.debug("closing stream: %r", exc)


def connection_ips(host: Any, peer_id: ID) -> list[str]:
    """The remote IPs of our live (direct, authenticated) connections to `peer_id`."""
    ips: list[str] = []
    for conn in host.libp2p.get_network().get_connections(peer_id):
        try:
            remote = conn.muxed_conn.get_remote_address()
        except (AttributeError, OSError):  # a connection closing under us
            continue
        if remote and remote[0] not in ips:
            ips.append(str(remote[0]))
    return ips[:MAX_OBSERVED_IPS]


async def serve_observed(host: Any, stream: Any) -> None:
    """The /prefixswarm/observed/1.0.0 handler: one question, one answer, closed."""
    try:
        with trio.fail_after(OBSERVED_TIMEOUT_S):
            query = parse_observed_query(await read_control(stream))
            try:
                peer_id = ID.from_base58(query.peer_id)
            except Exception as exc:  # base58/multihash raise assorted types
                raise RemoteProtocolError(f"not a peer id: {query.peer_id!r}") from exc
            await stream.write(ObservedAnswer(tuple(connection_ips(host, peer_id))).encode())
    except (RemoteProtocolError, trio.TooSlowError) as exc:
        logger.debug("observed? from a peer: %s", exc)
    except Exception as exc:  # the asker left: muxers raise many types
        logger.debug("observed? from a peer: %r", exc)
    finally:
        await close_quietly(stream)


async def ask_observed(host: Any, carrier: ID, peer_id: ID) -> list[str]:
    """Where `carrier` (the relay of a punch) sees `peer_id` connected from; [] when it
    does not say within OBSERVED_TIMEOUT_S (nothing is then dialled)."""
    try:
        with trio.fail_after(OBSERVED_TIMEOUT_S):
            stream = await host.new_stream(
                carrier, [OBSERVED_PROTOCOL], timeout_s=OBSERVED_TIMEOUT_S, relay=False
            )
            try:
                await stream.write(ObservedQuery(peer_id.to_base58()).encode())
                return list(parse_observed_answer(await read_control(stream)).ips)
            finally:
                await close_quietly(stream)
    except (RemoteProtocolError, trio.TooSlowError) as exc:
        logger.debug("observed? to %s: %s", carrier, exc)
    except Exception as exc:  # the relay is gone or predates the protocol
        logger.debug("observed? to %s: %r", carrier, exc)
    return []


def interface_networks() -> list[IPNetwork]:
    """This machine's interface networks (Linux): IPv4 by ioctl, IPv6 from /proc."""
    import fcntl
    import struct

    nets: list[IPNetwork] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            packed_name = struct.pack("256s", name[:15].encode())
            try:
                addr = fcntl.ioctl(sock.fileno(), 0x8915, packed_name)  # SIOCGIFADDR
                mask = fcntl.ioctl(sock.fileno(), 0x891B, packed_name)  # SIOCGIFNETMASK
            except OSError:
                continue  # an interface without an IPv4 address
            ip, netmask = socket.inet_ntoa(addr[20:24]), socket.inet_ntoa(mask[20:24])
            nets.append(ipaddress.ip_network(f"{ip}/{netmask}", strict=False))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and len(fields[0]) == 32:
                    ip6 = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                    nets.append(ipaddress.ip_network(f"{ip6}/{int(fields[2], 16)}",
                                                     strict=False))
    except (OSError, ValueError):
        pass  # no IPv6 here
    return nets or [ipaddress.ip_network("127.0.0.0/8")]
