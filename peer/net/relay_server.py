"""The relay side of /prefixswarm/relay/1.0.0: slots reserved by private peers and the
circuits joined to them, bounded by `RelayLimits` and the reservation rules
(peer/net/relay_reservations.py). `Reach` (peer/net/relay_service.py) owns one and
decides whether this peer relays at all.

A circuit reaches its target on /prefixswarm/relay-stop/1.0.0: a `RelayStop` header
(who asks, for which protocol), then the two ends run their own handshake through us
(peer/net/relay_channel.py). What we pipe after that is ciphertext.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.io.utils import read_exactly
from libp2p.peer.id import ID

from peer.net.punch_service import HOLEPUNCH_PROTOCOL
from peer.net.reachability import (
    CONTROL_FRAME_BYTES,
    RelayConnect,
    RelayLimits,
    RelayReply,
    RelayReserve,
    control_body_length,
    decode_control,
    parse_relay_request,
)
from peer.net.relay_reservations import Granted, ReservationBook, ReservationRules
from protocols.errors import RemoteProtocolError
from protocols.framing import FRAME_HEADER_BYTES, encode_frame
from protocols.ids import INFER_PROTOCOL

logger = logging.getLogger(__name__)

RELAY_PROTOCOL = "/prefixswarm/relay/1.0.0"
RELAY_STOP_PROTOCOL = "/prefixswarm/relay-stop/1.0.0"  # relay -> target: a circuit arrives
# what a circuit may carry: inference, ping, and the direct-connection upgrade
RELAYABLE = frozenset({INFER_PROTOCOL, str(PING_PROTOCOL_ID), HOLEPUNCH_PROTOCOL})
CONTROL_TIMEOUT_S = 5.0  # one control message each way on a live connection
PIPE_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class RelayStop:
    """Relay -> target, first on a relay-stop stream: `origin` asks for `protocol`.

    Both are claims of the relay's; the handshake that follows proves the origin and
    binds the protocol (peer/net/relay_channel.py)."""

    origin: str
    protocol: str

    def encode(self) -> bytes:
        return encode_frame(
            {"op": "stop", "origin": self.origin, "protocol": self.protocol},
            CONTROL_FRAME_BYTES,
        )

    @staticmethod
    def parse(raw: object) -> RelayStop:
        if not isinstance(raw, dict) or raw.get("op") != "stop":
            raise RemoteProtocolError(f"expected a relay stop, got {raw!r:.80}")
        origin, protocol = raw.get("origin"), raw.get("protocol")
        if not isinstance(origin, str) or not 0 < len(origin) <= 128:
            raise RemoteProtocolError("origin must be a peer id")
        if protocol not in RELAYABLE:
            raise RemoteProtocolError(f"protocol {protocol!r:.80} is not relayed")
        return RelayStop(origin, protocol)


async def read_control(stream: Any) -> object:
    """One length-prefixed control message (protocols.framing's header), decoded."""
    header = await read_exactly(stream, FRAME_HEADER_BYTES)
    return decode_control(await read_exactly(stream, control_body_length(header)))


async def close_stream(stream: Any) -> None:
    """Close within 1 s, shielded; reset a stream that cannot be closed."""
    with trio.move_on_after(1.0) as scope:
        scope.shield = True
        try:
            await stream.close()
        except Exception as exc:  # a stranger's stream: reset, EOF, closed; muxers vary
            logger.debug("closing relayed stream (%r); resetting it", exc)
            try:
                await stream.reset()
            except Exception as exc2:  # nothing left to clean up
                logger.debug("resetting relayed stream: %r", exc2)


class RelayServer:
    """Reservations held for others and the circuits open through this peer."""

    def __init__(
        self,
        host: Any,  # peer.net.host.SwarmHost (not imported: host imports us)
        limits: RelayLimits,
        stats: Counter[str],
        refusal: Callable[[], str | None],  # why this peer relays nothing now, or None
        rules: ReservationRules | None = None,
    ) -> None:
        self._host = host
        self.limits = limits
        self.stats = stats  # shared with Reach: one statistics() for the whole service
        self._refusal = refusal
        self._reservations = ReservationBook(rules or ReservationRules(
            max_total=limits.max_reservations, ttl_s=limits.reservation_ttl_s
        ))
        # peers refused a reservation whatever the book says (e.g. quarantined ones)
        self.excluded: Callable[[str], bool] = lambda peer_id: False
        self._circuits: Counter[str] = Counter()  # open circuits per origin and per target

    def reservations_held(self, now: float) -> int:
        self._reservations.expire(now)
        return len(self._reservations)

    def circuits_open(self) -> int:
        return sum(self._circuits.values()) // 2

    async def handle(self, stream: Any) -> None:
        """The /prefixswarm/relay/1.0.0 handler: a reservation or a circuit request."""
        origin = stream.muxed_conn.peer_id.to_base58()
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S):
                request = parse_relay_request(await read_control(stream))
        except Exception as exc:  # malformed or slow: drop it
            logger.debug("relay request from %s: %s", origin, exc)
            await close_stream(stream)
            return
        if isinstance(request, RelayReserve):
            await self._serve_reserve(stream, origin)
        else:
            await self._serve_connect(stream, origin, request)

    async def _reply(self, stream: Any, reply: RelayReply) -> bool:
        try:
            with trio.fail_after(CONTROL_TIMEOUT_S):
                await stream.write(reply.encode())
        except Exception as exc:  # the asker left
            logger.debug("relay reply: %s", exc)
            return False
        return True

    async def _serve_reserve(self, stream: Any, origin: str) -> None:
        """Grant when this peer relays, the asker is not excluded and the book has room."""
        refusal = self._refusal()
        if refusal is None and self.excluded(origin):
            refusal = "no reservation for this peer"
        if refusal is None:
            remote = stream.muxed_conn.get_remote_address()
            source = str(remote[0]) if remote else f"unknown:{origin}"
            decision = self._reservations.reserve(origin, source, trio.current_time())
            if isinstance(decision, Granted):
                self.stats["reservations_granted"] += 1
                if decision.evicted is not None:
                    self.stats["reservations_evicted"] += 1
                ttl = decision.expiry - trio.current_time()
                await self._reply(stream, RelayReply(True, ttl_s=ttl))
                await close_stream(stream)
                return
            refusal = decision.reason
        self.stats["reservations_refused"] += 1
        await self._reply(stream, RelayReply(False, refusal))
        await close_stream(stream)

    async def _serve_connect(self, stream: Any, origin: str, request: RelayConnect) -> None:
        now = trio.current_time()
        target = request.peer_id
        refusal = self._refusal()
        if refusal is None:
            if request.protocol not in RELAYABLE:
                refusal = f"protocol {request.protocol!r} is not relayed"
            elif not self._reservations.holds(target, now):
                refusal = "no reservation for that peer"
            elif sum(self._circuits.values()) // 2 >= self.limits.max_circuits:
                refusal = "relay is at its circuit limit"
            elif max(self._circuits[origin], self._circuits[target]) >= (
                self.limits.max_circuits_per_peer
            ):
                refusal = "relay is at its per-peer circuit limit"
        if refusal is not None:
            self.stats["circuits_refused"] += 1
            await self._reply(stream, RelayReply(False, refusal))
            await close_stream(stream)
            return
        self._circuits[origin] += 1
        self._circuits[target] += 1
        onward = None
        try:
            try:
                onward = await self._host.new_stream(
                    ID.from_base58(target), [RELAY_STOP_PROTOCOL], timeout_s=CONTROL_TIMEOUT_S,
                    relay=False,
                )
                with trio.fail_after(CONTROL_TIMEOUT_S):
                    await onward.write(RelayStop(origin, request.protocol).encode())
            except Exception as exc:  # the target left
                if onward is not None:
                    await close_stream(onward)
                self.stats["circuits_failed"] += 1
                await self._reply(stream, RelayReply(False, f"target unreachable: {exc}"))
                return
            if await self._reply(stream, RelayReply(True)):
                self.stats["circuits"] += 1
                await self._pipe(stream, onward)
            await close_stream(onward)
        finally:
            self._circuits[origin] -= 1
            self._circuits[target] -= 1
            await close_stream(stream)

    async def _pipe(self, a: Any, b: Any) -> None:
        """Join two streams both ways until one side ends, within the circuit limits."""
        limit = self.limits.max_circuit_bytes

        async def copy(src: Any, dst: Any, key: str) -> None:
            moved = 0
            try:
                while True:
                    data = await src.read(PIPE_CHUNK_BYTES)
                    if not data:
                        break
                    moved += len(data)
                    if moved > limit:
                        self.stats["circuits_cut_bytes"] += 1
                        break
                    await dst.write(data)
            except Exception as exc:  # EOF/reset on either side ends the circuit
                logger.debug("relay pipe: %s", exc)
            finally:
                self.stats[key] += moved
                nursery.cancel_scope.cancel()

        with trio.move_on_after(self.limits.max_circuit_s) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy, a, b, "relayed_bytes_forward")
                nursery.start_soon(copy, b, a, "relayed_bytes_back")
        if scope.cancelled_caught:
            self.stats["circuits_cut_time"] += 1
