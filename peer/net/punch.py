"""Direct-connection upgrade over a relay, the pure part: messages, the choice of
mechanism, the libp2p roles, the simultaneous-open timing and the per-peer attempt budget.

No I/O and no clock: time is a parameter; peer/net/punch_service.py is the trio shell.
/prefixswarm/holepunch/1.0.0 runs on a relayed stream: connection reversal when the
initiator is publicly dialable, else a TCP simultaneous open timed from the measured
round trip, roles fixed here (docs/protocol.md section 8b).
"""

from __future__ import annotations

import enum
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass

from protocols.errors import RemoteProtocolError
from protocols.framing import encode_frame

__all__ = [
    "ATTEMPTS_PER_PEER",
    "MAX_ADDRS",
    "Attempts",
    "Connect",
    "Mechanism",
    "ObservedAnswer",
    "ObservedQuery",
    "Result",
    "Role",
    "Sync",
    "choose_mechanism",
    "dialable_tcp",
    "parse_message",
    "parse_observed_answer",
    "parse_observed_query",
    "role_of",
    "sync_delay",
]

CONTROL_FRAME_BYTES = 2048  # a Connect holds at most MAX_ADDRS short addresses
MAX_ADDRS = 8  # addresses one side offers: each is dialled once per attempt
MAX_ADDR_CHARS = 128
MAX_PEER_ID_CHARS = 128  # base58 ed25519 ids are 52 characters
MAX_ERROR_CHARS = 200
ATTEMPTS_PER_PEER = 3  # failed upgrades in a row before the long pause below
BACKOFF_FIRST_S = 5.0  # after a failure, the next try waits this long, doubling
BACKOFF_MAX_S = 300.0  # ...and this long once ATTEMPTS_PER_PEER failed (networks change)
MAX_TRACKED_PEERS = 1024  # per-peer attempt records kept (least recently used dropped)
MAX_SYNC_DELAY_S = 2.0  # half a round trip longer than this is not a live relay
MAX_OBSERVED_IPS = 4  # IPs one answer names: the peer's connections are few
MAX_IP_CHARS = 45  # the longest textual IPv6 address


class Mechanism(enum.StrEnum):
    REVERSAL = "reversal"  # the NATed peer dials the public one back
    SIMULTANEOUS_OPEN = "simultaneous_open"  # both behind NAT: both dial at once


class Role(enum.Enum):
    DIALER = "dialer"  # outbound upgrade: Noise initiator, multistream/yamux client
    LISTENER = "listener"  # inbound upgrade on the socket it dialled


def role_of(*, initiator: bool) -> Role:
    """The libp2p role of one side of a simultaneous open: the initiator dials."""
    return Role.DIALER if initiator else Role.LISTENER


def choose_mechanism(*, initiator_public: bool, responder_addrs: int) -> Mechanism | None:
    """What the initiator asks for: reversal when it can be dialled, else a simultaneous
    open when the responder named an address to dial (None: nothing to try)."""
    if initiator_public:
        return Mechanism.REVERSAL
    return Mechanism.SIMULTANEOUS_OPEN if responder_addrs else None


def sync_delay(rtt_s: float) -> float:
    """How long the initiator waits after sending Sync: half the measured round trip, so
    that its SYN leaves when the responder's does (bounded: a stale relay is no clock)."""
    if rtt_s != rtt_s or rtt_s < 0:  # NaN or negative: a clock misuse by our own code
        raise ValueError(f"round trip must be >= 0, got {rtt_s}")
    return min(rtt_s / 2, MAX_SYNC_DELAY_S)


def dialable_tcp(addr: str) -> tuple[str, int] | None:
    """'/ip4/A/tcp/P' (or ip6) -> (A, P) when a direct dial there makes sense, else None.

    Refuses circuits, anything after the port, unspecified, multicast and broadcast
    addresses: a peer must not make us dial at nothing or at everybody."""
    parts = addr.split("/")
    if len(parts) != 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if (ip.version == 4) != (parts[1] == "ip4") or not 1 <= port <= 65535:
        return None
    if ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255":
        return None
    if parts[4] != str(port):  # '+80', '080': not the canonical form we send
        return None
    return str(ip), port


# -- messages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Connect:
    """Each side's addresses; the initiator's also names the mechanism and its peer id
    (a relayed stream does not say who opened it; the claim is checked by the dial's
    Noise handshake). Addresses are claims: peer/net/punch_policy.py dials only those at
    an IP where the relay carrying the punch sees that peer connected."""

    addrs: tuple[str, ...]
    mechanism: Mechanism | None = None  # None in the responder's answer
    peer_id: str = ""  # the initiator's; "" in the responder's answer

    def __post_init__(self) -> None:
        if len(self.addrs) > MAX_ADDRS:
            raise ValueError(f"at most {MAX_ADDRS} addresses, got {len(self.addrs)}")
        if (self.mechanism is None) != (self.peer_id == ""):
            raise ValueError("an initiator's Connect names mechanism and peer id, answers neither")

    def encode(self) -> bytes:
        body: dict[str, object] = {"type": "connect", "addrs": list(self.addrs)}
        if self.mechanism is not None:
            body["mechanism"] = self.mechanism.value
            body["peer"] = self.peer_id
        return encode_frame(body, CONTROL_FRAME_BYTES)


@dataclass(frozen=True)
class Sync:
    """Initiator -> responder: dial now (simultaneous open)."""

    def encode(self) -> bytes:
        return encode_frame({"type": "sync"}, CONTROL_FRAME_BYTES)


@dataclass(frozen=True)
class Result:
    """Responder -> initiator after its dial: whether it got a connection."""

    ok: bool
    error: str = ""

    def encode(self) -> bytes:
        return encode_frame(
            {"type": "result", "ok": self.ok, "error": self.error[:MAX_ERROR_CHARS]},
            CONTROL_FRAME_BYTES,
        )


Message = Connect | Sync | Result


def _addrs(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_ADDRS:
        raise RemoteProtocolError(f"addrs must be a list of at most {MAX_ADDRS}")
    out: list[str] = []
    for addr in raw:
        if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS:
            raise RemoteProtocolError(f"an address must be a string of 1..{MAX_ADDR_CHARS}")
        out.append(addr)  # undialable ones are skipped by the dialler (dialable_tcp)
    return tuple(out)


def parse_message(raw: object) -> Message:
    """A decoded control frame -> a typed message; RemoteProtocolError on anything else."""
    if not isinstance(raw, dict):
        raise RemoteProtocolError(f"expected a map, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "connect":
        mechanism, peer = raw.get("mechanism"), raw.get("peer")
        addrs = _addrs(raw.get("addrs"))
        if mechanism is None and peer is None:
            return Connect(addrs)
        if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_ID_CHARS:
            raise RemoteProtocolError(f"peer must be a string of 1..{MAX_PEER_ID_CHARS}")
        if not isinstance(mechanism, str) or mechanism not in set(Mechanism):
            raise RemoteProtocolError(f"unknown mechanism {mechanism!r}")
        return Connect(addrs, Mechanism(mechanism), peer)
    if kind == "sync":
        return Sync()
    if kind == "result":
        ok, error = raw.get("ok"), raw.get("error", "")
        if not isinstance(ok, bool):
            raise RemoteProtocolError("ok must be a boolean")
        if not isinstance(error, str) or len(error) > MAX_ERROR_CHARS:
            raise RemoteProtocolError(f"error must be a string of at most {MAX_ERROR_CHARS}")
        return Result(ok, error)
    raise RemoteProtocolError(f"unknown message type {kind!r}")


# -- where a relay sees a peer ----------------------------------------------------------------


@dataclass(frozen=True)
class ObservedQuery:
    """To the relay carrying a punch: 'where do you see this peer connect from?'."""

    peer_id: str

    def encode(self) -> bytes:
        return encode_frame({"type": "observed?", "peer": self.peer_id}, CONTROL_FRAME_BYTES)


@dataclass(frozen=True)
class ObservedAnswer:
    """The IPs of the answerer's live connections to that peer (none: not connected)."""

    ips: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.ips) > MAX_OBSERVED_IPS:
            raise ValueError(f"at most {MAX_OBSERVED_IPS} IPs, got {len(self.ips)}")

    def encode(self) -> bytes:
        return encode_frame({"type": "observed", "ips": list(self.ips)}, CONTROL_FRAME_BYTES)


def parse_observed_query(raw: object) -> ObservedQuery:
    if not isinstance(raw, dict) or raw.get("type") != "observed?":
        raise RemoteProtocolError("expected an observed? query")
    peer = raw.get("peer")
    if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_ID_CHARS:
        raise RemoteProtocolError(f"peer must be a string of 1..{MAX_PEER_ID_CHARS}")
    return ObservedQuery(peer)


def parse_observed_answer(raw: object) -> ObservedAnswer:
    if not isinstance(raw, dict) or raw.get("type") != "observed":
        raise RemoteProtocolError("expected an observed answer")
    ips = raw.get("ips")
    if not isinstance(ips, list) or len(ips) > MAX_OBSERVED_IPS:
        raise RemoteProtocolError(f"ips must be a list of at most {MAX_OBSERVED_IPS}")
    out: list[str] = []
    for ip in ips:
        if not isinstance(ip, str) or len(ip) > MAX_IP_CHARS:
            raise RemoteProtocolError("an observed IP must be a short string")
        try:
            out.append(str(ipaddress.ip_address(ip)))
        except ValueError as exc:
            raise RemoteProtocolError(f"not an IP address: {ip!r}") from exc
    return ObservedAnswer(tuple(out))


# -- the attempt budget -------------------------------------------------------------------


@dataclass
class _Record:
    failures: int = 0
    next_at: float = 0.0
    running: bool = False


class Attempts:
    """Per peer: at most one upgrade at a time, backoff after failures, a long pause after
    ATTEMPTS_PER_PEER failures in a row (at most one try per BACKOFF_MAX_S from then on).

    `try_start` says whether to start one now (and marks it running); `finished` records
    the outcome. A success clears the record: if the direct connection drops later, the
    next relayed stream may upgrade again."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def try_start(self, peer_id: str, now: float) -> bool:
        record = self._records.get(peer_id)
        if record is None:
            record = _Record()
            self._records[peer_id] = record
            while len(self._records) > MAX_TRACKED_PEERS:
                oldest = next(iter(self._records))
                if self._records[oldest].running:
                    break  # never forget a running attempt: it will call finished()
                del self._records[oldest]
        self._records.move_to_end(peer_id)
        if record.running or now < record.next_at:
            return False
        record.running = True
        return True

    def finished(self, peer_id: str, *, ok: bool, now: float) -> None:
        record = self._records.get(peer_id)
        if record is None or not record.running:
            raise ValueError(f"no upgrade to {peer_id} is running")
        if ok:
            del self._records[peer_id]
            return
        record.running = False
        record.failures += 1
        if record.failures >= ATTEMPTS_PER_PEER:
            record.next_at = now + BACKOFF_MAX_S
        else:
            record.next_at = now + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (record.failures - 1))

    def forget(self, peer_id: str) -> None:
        """The peer reconnected by other means: a fresh budget next time (if not running)."""
        record = self._records.get(peer_id)
        if record is not None and not record.running:
            del self._records[peer_id]

    def failures(self, peer_id: str) -> int:
        record = self._records.get(peer_id)
        return 0 if record is None else record.failures

    def __len__(self) -> int:
        return len(self._records)
