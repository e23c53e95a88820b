"""The end-to-end channel through a relay (peer/net/relay_channel.py), in memory: an
honest relay carries only ciphertext; a relay that changes, drops or replays a message,
answers as the target, or switches the protocol is caught."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.net.relay_channel import (
    RelayAuthError,
    RelayChannelError,
    SecuredStream,
    accept_circuit,
    secure_inbound,
    secure_outbound,
)
from peer.net.relay_server import RelayStop
from peer.net.wire import FrameStream, StreamBroken
from protocols.framing import MAX_FRAME_BYTES, encode_frame
from protocols.ids import INFER_PROTOCOL
from protocols.infer import InferRequest

SECRET = bytes(range(200, 256)) * 3


class MemoryStream:
    """The libp2p stream surface over one end of a trio memory stream pair."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        self._stream = stream

    async def read(self, n: int | None = None) -> bytes:
        return await self._stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self._stream.send_all(data)

    async def close(self) -> None:
        await self._stream.aclose()

    async def reset(self) -> None:
        await self._stream.aclose()


@pytest.fixture
async def pipes():
    """A nursery for the relay's pipes, cancelled when the test ends."""
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


Rewrite = Callable[[int, bytes], bytes | None]  # (index of the write, data) -> forwarded


def relayed_pair(
    nursery: trio.Nursery, seen: list[bytes], back: Rewrite | None = None
) -> tuple[MemoryStream, MemoryStream]:
    """(entry end, target end) joined by a relay that logs every byte and may rewrite
    (or drop, None) what flows back to the entry."""
    entry, relay_a = trio.testing.memory_stream_pair()
    relay_b, target = trio.testing.memory_stream_pair()

    async def pipe(src: trio.abc.Stream, dst: trio.abc.Stream, rewrite: Rewrite | None) -> None:
        index = 0
        while data := await src.receive_some(65536):
            seen.append(data)
            out = rewrite(index, data) if rewrite else data
            index += 1
            if out is not None:
                await dst.send_all(out)

    nursery.start_soon(pipe, relay_a, relay_b, None)
    nursery.start_soon(pipe, relay_b, relay_a, back)
    return MemoryStream(entry), MemoryStream(target)


async def handshake(
    entry_end, target_end, entry_key, target_key, *, target_protocol=INFER_PROTOCOL
):
    target_id = ID.from_pubkey(target_key.public_key)
    results: dict[str, object] = {}

    async def target_side() -> None:
        try:
            results["target"] = await secure_inbound(target_end, target_key, target_protocol)
        except RelayAuthError as exc:
            results["target"] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(target_side)
        try:
            results["entry"] = await secure_outbound(
                entry_end, entry_key, target_id, INFER_PROTOCOL
            )
        except RelayAuthError as exc:
            results["entry"] = exc
            nursery.cancel_scope.cancel()
    return results["entry"], results.get("target")


async def test_an_honest_relay_carries_only_ciphertext_and_both_ends_are_proven(pipes):
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    seen: list[bytes] = []
    entry_end, target_end = relayed_pair(pipes, seen)
    entry, target = await handshake(entry_end, target_end, entry_key, target_key)
    assert entry.remote_peer == ID.from_pubkey(target_key.public_key)
    assert target.muxed_conn.peer_id == ID.from_pubkey(entry_key.public_key)

    request = InferRequest(request_id="r", prompt_token_ids=tuple(range(300, 364)),
                           max_new_tokens=4, deadline_s=10.0)
    await FrameStream(entry).send(request)
    await entry.write(SECRET)
    frames = FrameStream(target)
    assert (await frames.receive())["prompt"] == list(range(300, 364))
    await target.write(b"answer")
    assert await entry.read(6) == b"answer"

    carried = b"".join(seen)
    frame = encode_frame(request.to_wire(), MAX_FRAME_BYTES)
    assert len(carried) > len(frame)  # it did carry the request...
    for window in (frame[i:i + 16] for i in range(0, len(frame) - 16, 8)):
        assert window not in carried  # ...but no 16 bytes of it in the clear
    assert SECRET[:16] not in carried and b"answer" not in carried


async def test_a_changed_byte_fails_authentication(pipes):
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()

    def flip_after_handshake(index: int, data: bytes) -> bytes:
        if index == 0:  # the handshake's second message
            return data
        return data[:-1] + bytes([data[-1] ^ 1])

    entry_end, target_end = relayed_pair(pipes, [], flip_after_handshake)
    entry, target = await handshake(entry_end, target_end, entry_key, target_key)
    flagged: list[int] = []
    entry.on_tampered = lambda: flagged.append(1)  # the entry then avoids that relay
    await target.write(b"tokens 1 2 3")
    with pytest.raises(RelayChannelError):
        await entry.read(12)
    assert flagged == [1]
    # what a forward reads frames with: a broken stream, never a message
    await target.write(b"x")
    with pytest.raises(StreamBroken):
        await FrameStream(entry).receive()


async def test_a_dropped_message_breaks_every_later_one(pipes):
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    entry_end, target_end = relayed_pair(pipes, [], lambda i, d: None if i == 1 else d)
    entry, target = await handshake(entry_end, target_end, entry_key, target_key)
    await target.write(b"first")  # dropped by the relay
    await trio.testing.wait_all_tasks_blocked()
    await target.write(b"second")
    with pytest.raises(RelayChannelError):
        await entry.read(6)


async def test_a_replayed_message_fails(pipes):
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    entry_end, target_end = relayed_pair(pipes, [], lambda i, d: d + d if i == 1 else d)
    entry, target = await handshake(entry_end, target_end, entry_key, target_key)
    await target.write(b"once")
    assert await entry.read(4) == b"once"
    with pytest.raises(RelayChannelError):
        await entry.read(4)


async def test_a_relay_cannot_answer_as_the_target(pipes):
    """The relay runs the handshake itself with its own key: the entry sees another id."""
    entry_key, target_key, relay_key = (create_new_key_pair() for _ in range(3))
    entry_end, relay_end = trio.testing.memory_stream_pair()
    target_id = ID.from_pubkey(target_key.public_key)

    async def impersonate() -> None:
        with pytest.raises(RelayAuthError):
            await secure_inbound(MemoryStream(relay_end), relay_key, INFER_PROTOCOL)

    pipes.start_soon(impersonate)
    with pytest.raises(RelayAuthError, match="failed") as caught:
        await secure_outbound(MemoryStream(entry_end), entry_key, target_id, INFER_PROTOCOL)
    assert caught.value.meddled  # the entry avoids that relay


async def test_a_relay_answering_in_the_clear_is_refused(pipes):
    """An old-style plaintext answer (a frame of tokens) is no handshake message."""
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    entry_end, relay_end = trio.testing.memory_stream_pair()

    async def plaintext() -> None:
        await relay_end.receive_some(65536)
        await relay_end.send_all(b"\x00\x10" + b"\xa1\x66tokens\x83\x01\x02\x03" + b"\x00" * 4)
        await relay_end.aclose()

    pipes.start_soon(plaintext)
    with pytest.raises(RelayAuthError) as caught:
        await secure_outbound(
            MemoryStream(entry_end), entry_key, ID.from_pubkey(target_key.public_key),
            INFER_PROTOCOL,
        )
    assert caught.value.meddled


async def test_a_circuit_that_just_ends_is_no_evidence_against_the_relay(pipes):
    """A target that left or refused the circuit: the relay stays usable."""
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    entry_end, relay_end = trio.testing.memory_stream_pair()

    async def hang_up() -> None:
        await relay_end.receive_some(65536)
        await relay_end.aclose()

    pipes.start_soon(hang_up)
    with pytest.raises(RelayAuthError) as caught:
        await secure_outbound(
            MemoryStream(entry_end), entry_key, ID.from_pubkey(target_key.public_key),
            INFER_PROTOCOL,
        )
    assert not caught.value.meddled


async def test_a_switched_protocol_breaks_the_handshake(pipes):
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    entry_end, target_end = relayed_pair(pipes, [])
    entry, target = await handshake(
        entry_end, target_end, entry_key, target_key, target_protocol="/ipfs/ping/1.0.0"
    )
    assert isinstance(entry, RelayAuthError) or isinstance(target, RelayAuthError)


async def test_a_silent_relay_times_out_in_virtual_time(autojump_clock):
    entry_key, target_key = create_new_key_pair(), create_new_key_pair()
    entry_end, _silent = trio.testing.memory_stream_pair()
    start = trio.current_time()
    with pytest.raises(RelayAuthError, match="within") as caught:
        await secure_outbound(
            MemoryStream(entry_end), entry_key, ID.from_pubkey(target_key.public_key),
            INFER_PROTOCOL,
        )
    assert trio.current_time() - start == pytest.approx(5.0)
    assert not caught.value.meddled


# -- the target's side of a circuit (accept_circuit) -------------------------------------


class FromRelay(MemoryStream):
    """A relay-stop stream as the target sees it: its connection names the relay."""

    def __init__(self, stream: trio.abc.HalfCloseableStream, relay: ID) -> None:
        super().__init__(stream)
        self.muxed_conn = type("Conn", (), {"peer_id": relay})()


async def circuit(
    *, allowed: bool = True, claimed_origin: str | None = None, protocol: str = INFER_PROTOCOL
) -> tuple[list[object], Counter[str], object]:
    """Run accept_circuit against an entry that handshakes through a relay; returns the
    streams the protocol handler got, the stats, and the entry's outcome."""
    entry_key, target_key, relay_key = (create_new_key_pair() for _ in range(3))
    relay_id = ID.from_pubkey(relay_key.public_key)
    entry_id = ID.from_pubkey(entry_key.public_key).to_base58()
    entry_end, target_end = trio.testing.memory_stream_pair()
    handled: list[object] = []
    stats: Counter[str] = Counter()

    async def handler(stream: object) -> None:
        handled.append(stream)

    async def target_side() -> None:
        await accept_circuit(
            FromRelay(target_end, relay_id), target_key,
            relay_allowed=lambda relay: allowed and relay == relay_id.to_base58(),
            handler_for=lambda p: handler if p == INFER_PROTOCOL else None, stats=stats,
        )

    outcome: object = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(target_side)
        try:
            await entry_end.send_all(RelayStop(claimed_origin or entry_id, protocol).encode())
            outcome = await secure_outbound(
                MemoryStream(entry_end), entry_key, ID.from_pubkey(target_key.public_key),
                INFER_PROTOCOL,
            )
        except (RelayAuthError, trio.BrokenResourceError) as exc:  # refused, or closed on us
            outcome = exc
    return handled, stats, outcome


async def test_a_circuit_reaches_the_handler_as_the_proven_origin():
    handled, stats, outcome = await circuit()
    assert stats["relayed_inbound"] == 1 and len(handled) == 1
    assert isinstance(handled[0], SecuredStream) and not isinstance(outcome, Exception)
    assert handled[0].muxed_conn.peer_id == outcome._session.get_local_peer()


async def test_a_circuit_from_a_relay_we_hold_no_slot_on_is_refused():
    handled, stats, outcome = await circuit(allowed=False)
    assert handled == [] and stats["relayed_inbound_refused"] == 1
    assert isinstance(outcome, Exception)


async def test_a_relay_naming_another_origin_is_refused():
    other = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    handled, stats, _ = await circuit(claimed_origin=other)
    assert handled == [] and stats["relayed_inbound_refused"] == 1


async def test_only_relayed_protocols_are_accepted():
    handled, stats, outcome = await circuit(protocol="/prefixswarm/lookup/1.0.0")
    assert handled == [] and stats["relayed_inbound_refused"] == 1
    assert isinstance(outcome, Exception)


# -- the entry avoids a relay that failed it -----------------------------------------------


class _Peerstore:
    def addrs(self, peer_id: ID) -> list[str]:
        from libp2p.peer.peerstore import PeerStoreError

        raise PeerStoreError("unknown")


class _Host:
    def __init__(self, connected: list[ID]) -> None:
        self._connected = connected
        self.libp2p = type("Libp2p", (), {"get_peerstore": lambda _self: _Peerstore()})()

    def connected_peers(self) -> list[ID]:
        return list(self._connected)


async def test_a_relay_that_failed_end_to_end_is_avoided_for_a_while(autojump_clock):
    from peer.net.relay_service import BAD_RELAY_S, Reach

    relays = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(3)]
    target = ID.from_pubkey(create_new_key_pair().public_key)
    reach = Reach(_Host(relays), listen_ports=(), announce=(), relay_service=True,
                  use_relays=True)
    assert set(reach.relay_candidates(target)) == set(relays)
    reach.note_bad_relay(relays[0].to_base58())
    assert set(reach.relay_candidates(target)) == set(relays[1:])
    await trio.sleep(BAD_RELAY_S)
    assert set(reach.relay_candidates(target)) == set(relays)
