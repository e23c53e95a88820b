"""Reachability and relays, the pure part: verdicts from dial-backs, relay reservations,
the small control messages of the dial-back and relay protocols, and address rules.

No I/O and no clock: time is a parameter. peer/net/relay_service.py is the trio shell around it.

Reachability (an AutoNAT equivalent): a peer asks peers it is connected to to open a
fresh TCP connection back to it, on the IP they see it connect from and the ports it
listens on. An answer is a claim: it becomes PUBLIC only when PUBLIC_QUORUM reporters in
distinct networks (/24 for IPv4, /48 for IPv6: one operator rarely holds many) each
reached it at the same address, so one liar (or several in one network) can neither
flip a peer behind NAT to PUBLIC (it would drop its relays) nor make it advertise an
address of the liar's choosing. Failures from MIN_FAILING_PEERS peers and no quorum
make it PRIVATE (behind NAT or a firewall); a peer with no listen port is PRIVATE at
once (outbound only). Every answer expires after RESULT_TTL_S.
"""

from __future__ import annotations

import enum
import ipaddress
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocols.errors import RemoteProtocolError
from protocols.framing import decode_cbor, encode_frame

__all__ = [
    "CONTROL_FRAME_BYTES",
    "MAX_DIALBACK_PORTS",
    "PUBLIC_QUORUM",
    "CheckSchedule",
    "DialBackRequest",
    "DialBackResponse",
    "Reachability",
    "ReachabilityTracker",
    "RelayConnect",
    "RelayLimits",
    "RelayReply",
    "RelayReserve",
    "Reservations",
    "circuit_addr",
    "control_body_length",
    "decode_control",
    "expand_unspecified",
    "is_circuit",
    "network_of",
    "parse_relay_request",
    "relay_of",
    "unknown_check_delay",
]

CONTROL_FRAME_BYTES = 1024  # every control message is a few dozen bytes
MAX_DIALBACK_PORTS = 4  # ports one dial-back request may name (bounds the work we do)
MAX_PEER_ID_CHARS = 128  # base58 ed25519 ids are 52 characters
MAX_PROTOCOL_CHARS = 64
MAX_TEXT_CHARS = 200  # error texts in replies
# Distinct peers whose dial-back failed before we say PRIVATE. One: a volunteer behind
# NAT is often connected to a single peer at first, and UNKNOWN would leave it without
# relays; one later success (any peer) makes it PUBLIC again.
MIN_FAILING_PEERS = 1
# Reporters in distinct networks that must each have reached us at one address before we
# say PUBLIC: one is a single liar's word; three is AutoNAT v1's confidence as well.
PUBLIC_QUORUM = 3
IPV4_NETWORK_BITS = 24  # reporters within one /24 count as one network...
IPV6_NETWORK_BITS = 48  # ...and within one /48 (a site's allocation)
RESULT_TTL_S = 900.0  # a dial-back result is evidence for this long (networks change)
MAX_RESULTS = 32  # results kept: one per asking peer is enough


class Reachability(enum.StrEnum):
    UNKNOWN = "unknown"  # not enough evidence yet
    PUBLIC = "public"  # another peer opened a connection to us
    PRIVATE = "private"  # peers could not: behind NAT or a firewall, or outbound only


def network_of(ip: str) -> str:
    """The network a reporter's IP stands for: its /24 (IPv4, IPv4-mapped IPv6 included)
    or /48 (IPv6); "" for anything unparsable (all such reporters are one network)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    bits = IPV4_NETWORK_BITS if addr.version == 4 else IPV6_NETWORK_BITS
    return str(ipaddress.ip_network(f"{addr}/{bits}", strict=False))


@dataclass
class _Result:
    ok: bool
    addr: str
    at: float
    network: str  # the reporter's network (network_of its IP)


def unknown_check_delay(quiet_rounds: int, first_s: float, most_s: float) -> float:
    """The wait before the next reachability check while the verdict is unknown:
    `first_s`, doubled for each round in a row that could ask only peers asked before
    (their answers are already in: asking them again mostly repeats them; in one /24,
    as on a LAN, PUBLIC_QUORUM is never reached and the checks would go on every
    `first_s` forever), at most `most_s`."""
    if quiet_rounds < 0:
        raise ValueError(f"quiet_rounds must be >= 0, got {quiet_rounds}")
    return min(most_s, first_s * 2.0 ** min(quiet_rounds, 32))


MAX_ASKED_REMEMBERED = 256  # peers asked for a dial-back, remembered to prefer new ones
Peer = TypeVar("Peer", bound=Hashable)


class CheckSchedule(Generic[Peer]):
    """Whom each reachability check asks, and how long to wait while the verdict is
    unknown: connected peers never asked come first; a round that can ask only peers
    asked before is quiet, and quiet rounds in a row double the wait
    (unknown_check_delay)."""

    def __init__(self, fanout: int, remembered: int = MAX_ASKED_REMEMBERED) -> None:
        self._fanout = fanout
        self._remembered = remembered
        self._asked: OrderedDict[Peer, None] = OrderedDict()
        self._quiet = 0

    def choose(self, peers: Sequence[Peer], rng: random.Random) -> list[Peer]:
        """At most `fanout` of `peers` to ask now, never-asked ones first."""
        new = [p for p in peers if p not in self._asked]
        old = [p for p in peers if p in self._asked]
        self._quiet = 0 if new else self._quiet + 1
        asked = rng.sample(new, min(self._fanout, len(new)))
        asked += rng.sample(old, min(self._fanout - len(asked), len(old)))
        for peer in asked:
            self._asked.pop(peer, None)
            self._asked[peer] = None
        while len(self._asked) > self._remembered:
            self._asked.popitem(last=False)
        return asked

    def unknown_delay(self, first_s: float, most_s: float) -> float:
        return unknown_check_delay(self._quiet, first_s, most_s)


class ReachabilityTracker:
    """Dial-back results from distinct peers -> a verdict and the confirmed addresses."""

    def __init__(self, *, listen_ports: int) -> None:
        self._listen_ports = listen_ports
        self._results: OrderedDict[str, _Result] = OrderedDict()  # by asking peer

    def record(
        self, peer_id: str, *, ok: bool, addr: str, now: float, reporter_ip: str = ""
    ) -> None:
        """Peer `peer_id`, connected to us from `reporter_ip`, tried to dial us at `addr`
        (a multiaddr without /p2p; the IP in it is the one the reporter says it saw)."""
        self._results.pop(peer_id, None)
        self._results[peer_id] = _Result(ok, addr, now, network_of(reporter_ip))
        while len(self._results) > MAX_RESULTS:
            self._results.popitem(last=False)

    def _fresh(self, now: float) -> list[_Result]:
        return [r for r in self._results.values() if now - r.at <= RESULT_TTL_S]

    def _agreement(self, now: float) -> dict[str, set[str]]:
        """For each address, the distinct reporter networks that reached us there."""
        networks: dict[str, set[str]] = {}
        for r in self._fresh(now):
            if r.ok:
                networks.setdefault(r.addr, set()).add(r.network)
        return networks

    def verdict(self, now: float) -> Reachability:
        if self._listen_ports == 0:
            return Reachability.PRIVATE
        if self.confirmed_addrs(now):
            return Reachability.PUBLIC
        if sum(1 for r in self._fresh(now) if not r.ok) >= MIN_FAILING_PEERS:
            return Reachability.PRIVATE
        return Reachability.UNKNOWN

    def confirmed_addrs(self, now: float) -> list[str]:
        """Addresses PUBLIC_QUORUM reporter networks reached us at (most agreed first)."""
        agreed = self._agreement(now)
        quorum = [a for a, nets in agreed.items() if len(nets) >= PUBLIC_QUORUM]
        return sorted(quorum, key=lambda a: -len(agreed[a]))

    def observed_addrs(self, now: float) -> list[str]:
        """Where peers saw us come from (observed IP, our listen port), dialable or not:
        the address a hole punch aims at, since a NAT that keeps source ports maps our
        listen port there. Those reported from the most networks first, then newest;
        deduplicated (a liar's address comes after every agreed one)."""
        fresh = self._fresh(now)
        networks: dict[str, set[str]] = {}
        for r in reversed(fresh):
            networks.setdefault(r.addr, set()).add(r.network)
        return sorted(networks, key=lambda a: -len(networks[a]))  # stable: newest first

    def evidence(self, now: float) -> dict[str, int]:
        fresh = self._fresh(now)
        agreed = self._agreement(now)
        return {
            "ok": sum(r.ok for r in fresh),
            "failed": sum(not r.ok for r in fresh),
            "agreeing_networks": max((len(n) for n in agreed.values()), default=0),
            "quorum": PUBLIC_QUORUM,
        }


# -- relay limits and reservations -------------------------------------------------------


@dataclass(frozen=True)
class RelayLimits:
    """What a relay gives away; every circuit is bounded in bytes and time."""

    max_reservations: int = 64  # peers that may be reached through us
    reservation_ttl_s: float = 300.0  # a reservation lapses unless refreshed
    max_circuits: int = 32  # relayed streams open at once
    max_circuits_per_peer: int = 8  # ...of which for one target or one origin
    max_circuit_bytes: int = 16 << 20  # per circuit and direction: a 128k-token prompt is ~1 MB
    max_circuit_s: float = 600.0  # a circuit is cut after this long (>= request deadlines)

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "max_circuits_per_peer",
                     "max_circuit_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("reservation_ttl_s", "max_circuit_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Reservations:
    """Peers that reserved a slot on this relay, with expiry; bounded by max_reservations."""

    limits: RelayLimits
    _expiry: dict[str, float] = field(default_factory=dict)

    def reserve(self, peer_id: str, now: float) -> float | None:
        """Grant or refresh a reservation; returns its expiry, None when full."""
        self.expire(now)
        if peer_id not in self._expiry and len(self._expiry) >= self.limits.max_reservations:
            return None
        expiry = now + self.limits.reservation_ttl_s
        self._expiry[peer_id] = expiry
        return expiry

    def holds(self, peer_id: str, now: float) -> bool:
        expiry = self._expiry.get(peer_id)
        return expiry is not None and now < expiry

    def expire(self, now: float) -> None:
        for peer_id in [p for p, e in self._expiry.items() if now >= e]:
            del self._expiry[peer_id]

    def __len__(self) -> int:
        return len(self._expiry)


# -- control messages ----------------------------------------------------------------------


def _text(obj: dict[object, object], key: str, limit: int, *, required: bool = True) -> str:
    value = obj.get(key, None if required else "")
    if not isinstance(value, str) or len(value) > limit or (required and not value):
        raise RemoteProtocolError(f"field {key!r} must be a string of 1..{limit} characters")
    return value


def _map(raw: object) -> dict[object, object]:
    if not isinstance(raw, dict):
        raise RemoteProtocolError(f"expected a map, got {type(raw).__name__}")
    return raw


@dataclass(frozen=True)
class DialBackRequest:
    """'Dial me back on these ports, at the IP you see me at.'"""

    ports: tuple[int, ...]

    def encode(self) -> bytes:
        return encode_frame({"ports": list(self.ports)}, CONTROL_FRAME_BYTES)

    @staticmethod
    def parse(raw: object) -> DialBackRequest:
        ports = _map(raw).get("ports")
        if not isinstance(ports, list) or len(ports) > MAX_DIALBACK_PORTS:
            raise RemoteProtocolError(f"ports must be a list of at most {MAX_DIALBACK_PORTS}")
        for port in ports:
            if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
                raise RemoteProtocolError(f"not a TCP port: {port!r}")
        return DialBackRequest(tuple(ports))


@dataclass(frozen=True)
class DialBackResponse:
    """Which of the requested addresses answered a fresh connection, and our view of you."""

    observed_ip: str
    ok_ports: tuple[int, ...]

    def encode(self) -> bytes:
        return encode_frame(
            {"observed_ip": self.observed_ip, "ok_ports": list(self.ok_ports)}, CONTROL_FRAME_BYTES
        )

    @staticmethod
    def parse(raw: object, asked: DialBackRequest) -> DialBackResponse:
        obj = _map(raw)
        ip = _text(obj, "observed_ip", 64)
        try:
            ipaddress.ip_address(ip)
        except ValueError as exc:
            raise RemoteProtocolError(f"observed_ip is not an IP address: {ip!r}") from exc
        ports = obj.get("ok_ports")
        if not isinstance(ports, list) or not set(ports) <= set(asked.ports):
            raise RemoteProtocolError("ok_ports must be a subset of the ports asked for")
        return DialBackResponse(ip, tuple(ports))


@dataclass(frozen=True)
class RelayReserve:
    """Sent by a peer that is not reachable: 'relay to me'."""

    def encode(self) -> bytes:
        return encode_frame({"op": "reserve"}, CONTROL_FRAME_BYTES)


@dataclass(frozen=True)
class RelayConnect:
    """Sent by an entry peer: 'open `protocol` to `peer_id` and join the two streams'."""

    peer_id: str
    protocol: str

    def encode(self) -> bytes:
        return encode_frame(
            {"op": "connect", "peer": self.peer_id, "proto": self.protocol}, CONTROL_FRAME_BYTES
        )


def parse_relay_request(raw: object) -> RelayReserve | RelayConnect:
    obj = _map(raw)
    op = obj.get("op")
    if op == "reserve":
        return RelayReserve()
    if op == "connect":
        return RelayConnect(
            _text(obj, "peer", MAX_PEER_ID_CHARS), _text(obj, "proto", MAX_PROTOCOL_CHARS)
        )
    raise RemoteProtocolError(f"unknown relay op {op!r}")


@dataclass(frozen=True)
class RelayReply:
    ok: bool
    error: str = ""
    ttl_s: float = 0.0  # a reservation's lifetime

    def encode(self) -> bytes:
        return encode_frame(
            {"ok": self.ok, "error": self.error[:MAX_TEXT_CHARS], "ttl_s": float(self.ttl_s)},
            CONTROL_FRAME_BYTES,
        )

    @staticmethod
    def parse(raw: object) -> RelayReply:
        obj = _map(raw)
        ok, ttl = obj.get("ok"), obj.get("ttl_s", 0.0)
        if not isinstance(ok, bool):
            raise RemoteProtocolError("ok must be a boolean")
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 0 <= ttl <= 86400:
            raise RemoteProtocolError(f"ttl_s out of range: {ttl!r}")
        return RelayReply(ok, _text(obj, "error", MAX_TEXT_CHARS, required=False), float(ttl))


def control_body_length(header: bytes) -> int:
    """The length announced by a control frame's 4-byte header, checked against the bound."""
    length = int.from_bytes(header, "big")
    if not 1 <= length <= CONTROL_FRAME_BYTES:
        raise RemoteProtocolError(f"control frame of {length} bytes (limit {CONTROL_FRAME_BYTES})")
    return length


def decode_control(body: bytes) -> object:
    return decode_cbor(body)


# -- addresses -------------------------------------------------------------------------------

CIRCUIT = "/p2p-circuit"


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def circuit_addr(relay_addr: str, target_peer_id: str) -> str:
    """'/ip4/R/tcp/P/p2p/<relay>' + our id -> the relayed address others can use."""
    return f"{relay_addr}{CIRCUIT}/p2p/{target_peer_id}"


def relay_of(addr: str) -> str | None:
    """The relay's peer id in a circuit address, else None."""
    head, sep, _tail = addr.partition(CIRCUIT)
    if not sep or "/p2p/" not in head:
        return None
    return head.rsplit("/p2p/", 1)[1] or None


def expand_unspecified(addr: str, interface_ips: list[str]) -> list[str]:
    """'/ip4/0.0.0.0/tcp/P' -> one address per interface IP (loopback last); others as-is."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] != "ip4" or parts[2] != "0.0.0.0":
        return [addr]
    ordered = sorted(interface_ips, key=lambda ip: ipaddress.ip_address(ip).is_loopback)
    return ["/".join([*parts[:2], ip, *parts[3:]]) for ip in ordered]
