"""peer/net/wire.py: frames over a stream, its error family, the bounded reset."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from peer.net.wire import (
    RESET_TIMEOUT_S,
    FrameStream,
    PeerUnreachable,
    StreamBroken,
    StreamRefused,
    WireError,
    read_frame_sized,
    reset_quietly,
)
from protocols.errors import RemoteProtocolError
from protocols.framing import encode_frame
from protocols.load import LoadQuery


class Pipe:
    """One end of a trio memory stream with the stream methods the wire uses."""

    def __init__(self, stream: trio.testing.MemoryStream | trio.abc.Stream) -> None:
        self._s = stream
        self.resets = 0

    async def read(self, n: int | None = None) -> bytes:
        return bytes(await self._s.receive_some(n))

    async def write(self, data: bytes) -> None:
        await self._s.send_all(data)

    async def close(self) -> None:
        await self._s.aclose()

    async def reset(self) -> None:
        self.resets += 1
        await self._s.aclose()


def test_one_error_family():
    for error in (PeerUnreachable, StreamBroken, StreamRefused):
        assert issubclass(error, WireError)
    assert issubclass(StreamRefused, StreamBroken)


async def test_frames_round_trip_and_count_bytes():
    a, b = trio.testing.memory_stream_pair()
    sent = await FrameStream(Pipe(a)).send(LoadQuery())
    frame, size = await read_frame_sized(Pipe(b), 64)
    assert frame == LoadQuery().to_wire()
    assert size == sent == len(encode_frame(LoadQuery().to_wire()))


async def test_an_end_before_the_first_frame_is_a_refusal_after_it_a_break():
    a, b = trio.testing.memory_stream_pair()
    frames = FrameStream(Pipe(b))
    await a.send_all(encode_frame(LoadQuery().to_wire()))
    await a.aclose()
    assert await frames.receive() == LoadQuery().to_wire()
    with pytest.raises(StreamBroken) as broken:
        await frames.receive()
    assert not isinstance(broken.value, StreamRefused)

    a, b = trio.testing.memory_stream_pair()
    await a.aclose()
    with pytest.raises(StreamRefused, match="end of stream"):
        await FrameStream(Pipe(b)).receive()


async def test_an_oversize_frame_is_a_protocol_error():
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(encode_frame({"x": b"0" * 200}))
    with pytest.raises(RemoteProtocolError):
        await FrameStream(Pipe(b), max_bytes=64).receive()


async def test_a_stalled_reset_gives_up_after_its_bound(autojump_clock):
    class Stalled(Pipe):
        async def reset(self) -> None:
            await trio.sleep_forever()

    a, _ = trio.testing.memory_stream_pair()
    start = trio.current_time()
    with trio.CancelScope() as outer:
        outer.cancel()  # shielded: a reset runs even in a cancelled scope, within its bound
        await reset_quietly(Stalled(a))
    assert trio.current_time() - start == RESET_TIMEOUT_S
