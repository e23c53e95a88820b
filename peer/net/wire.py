"""The wire: what the protocols above net/ use of a libp2p stream.

- The stream seams, as narrow Protocols: `StreamOpener` opens streams (peer.net.host's
  SwarmHost; tests/fake_host.py), `HandlerHost` registers the handlers of the protocols
  a peer answers, `InboundStream` is a stream another peer opened.
- One error family, `WireError`: `PeerUnreachable` (no stream could be opened),
  `StreamBroken` (the stream failed before the exchange was complete) and its
  `StreamRefused` (the peer ended the stream without answering at all).
- `FrameStream`: frames (protocols/framing.py) over one stream, in 64 KiB reads, and the
  1 s shielded reset (`reset_quietly`); `read_frame` for one-frame exchanges;
  `BoundedAnswers` runs one-request handlers within a deadline and a concurrency bound.
No deadline is set here except the reset's: the caller's `trio.fail_after` bounds the
waits (STYLE.md item 6).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import trio
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from protocols.errors import RemoteProtocolError
from protocols.framing import MAX_FRAME_BYTES, FrameDecoder, encode_frame

__all__ = [
    "READ_BYTES",
    "RESET_TIMEOUT_S",
    "BoundedAnswers",
    "FrameStream",
    "HandlerHost",
    "InboundStream",
    "PeerUnreachable",
    "StreamBroken",
    "StreamLike",
    "StreamOpener",
    "StreamRefused",
    "WireError",
    "read_frame",
    "read_frame_sized",
    "reset_quietly",
]

logger = logging.getLogger(__name__)

READ_BYTES = 64 * 1024  # one read: a whole small frame, or a large one in a few reads
RESET_TIMEOUT_S = 1.0  # a reset is one small write; a stalled peer must not hold us


# -- errors -----------------------------------------------------------------------------


class WireError(Exception):
    """A remote exchange failed below its protocol: no stream, or the stream failed."""


class PeerUnreachable(WireError):
    """A remote peer could not be dialled, pinged or opened a stream to in time."""


class StreamBroken(WireError):
    """The stream ended (EOF, reset, closed) or failed before the exchange was complete."""


class StreamRefused(StreamBroken):
    """The peer ended the stream before sending a single frame: it would not answer."""


# -- the stream seams -------------------------------------------------------------------


class StreamLike(Protocol):
    """One bidirectional stream (py-libp2p's INetStream; the fake host's in tests)."""

    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close(self) -> None: ...
    async def reset(self) -> None: ...


class StreamOpener(Protocol):
    """What a forward, a load probe and a lookup use of the libp2p host
    (peer.net.host.SwarmHost; tests/fake_host.py). Raises PeerUnreachable. `lazy`: the
    first message may leave before the peer accepted the protocol (a refusal then shows
    on the first read); such a stream, sent on a connection already held (no dial, relay
    or negotiation before it), says so with `direct = True` (lazy_select.LazyStream)."""

    async def new_stream(
        self, peer_id: ID, protocols: Sequence[str], *, timeout_s: float = ...,
        lazy: bool = ...,
    ) -> StreamLike: ...


class _RemotePeer(Protocol):
    @property
    def peer_id(self) -> ID: ...


class InboundStream(StreamLike, Protocol):
    """A stream another peer opened to us: its connection names that peer."""

    @property
    def muxed_conn(self) -> _RemotePeer: ...


class HandlerHost(Protocol):
    """What serving uses of the raw py-libp2p host: a handler per protocol it answers.

    The handler is called with py-libp2p's INetStream, which is an `InboundStream`."""

    def set_stream_handler(self, protocol_id: TProtocol, stream_handler: StreamHandlerFn) -> None:
        ...


class Message(Protocol):
    """A protocol message: its wire form is a CBOR-able object."""

    def to_wire(self) -> dict[str, object]: ...


# -- frames -----------------------------------------------------------------------------


async def reset_quietly(stream: StreamLike) -> None:
    """Reset ``stream`` within RESET_TIMEOUT_S, whatever state it is in; never raises."""
    with trio.move_on_after(RESET_TIMEOUT_S) as scope:
        scope.shield = True
        with contextlib.suppress(BaseLibp2pError):
            await stream.reset()


class FrameStream:
    """Frames over one stream. Reads and writes raise StreamBroken (StreamRefused when
    the stream ends before its first frame) or, for a malformed or oversize frame,
    RemoteProtocolError."""

    def __init__(self, stream: StreamLike, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.stream = stream
        self._max_bytes = max_bytes
        self._decoder = FrameDecoder(max_bytes)
        self.frames_received = 0
        self.bytes_received = 0  # bytes read from the stream so far

    async def send(self, message: Message) -> int:
        """Write one message as a frame (ValueError if over ``max_bytes``); its size."""
        data = encode_frame(message.to_wire(), self._max_bytes)
        try:
            await self.stream.write(data)
        except BaseLibp2pError as exc:
            raise StreamBroken(f"write failed: {exc!r}") from exc
        return len(data)

    async def receive(self) -> object:
        """The next frame's decoded CBOR object (not yet validated as a message)."""
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                self.frames_received += 1
                return frame
            broken = StreamBroken if self.frames_received else StreamRefused
            try:
                data = await self.stream.read(READ_BYTES)
            except BaseLibp2pError as exc:  # StreamEOF, StreamReset, ...
                raise broken(f"read failed: {exc!r}") from exc
            if not data:
                raise broken("end of stream")
            self.bytes_received += len(data)
            self._decoder.feed(data)

    async def close(self) -> None:
        """Close gracefully if possible, else reset; never raises, never blocks long."""
        with trio.move_on_after(RESET_TIMEOUT_S) as scope:
            scope.shield = True
            try:
                await self.stream.close()
            except BaseLibp2pError:
                with contextlib.suppress(BaseLibp2pError):
                    await self.stream.reset()

    async def reset(self) -> None:
        await reset_quietly(self.stream)


async def read_frame(stream: StreamLike, max_bytes: int) -> object:
    """The one frame of a one-request exchange (FrameStream.receive's errors)."""
    frame, _ = await read_frame_sized(stream, max_bytes)
    return frame


async def read_frame_sized(stream: StreamLike, max_bytes: int) -> tuple[object, int]:
    """`read_frame`, and the bytes read from the stream for it."""
    frames = FrameStream(stream, max_bytes)
    frame = await frames.receive()
    return frame, frames.bytes_received


S = TypeVar("S", bound=StreamLike)


class BoundedAnswers:
    """Runs one-request stream handlers: at most `limit` at once (a flood costs a reset
    each), each within `timeout_s`; a bad or late request is reset. Counts
    `<name>_refused` and `<name>_bad` in `stats`."""

    def __init__(self, name: str, limit: int, timeout_s: float, stats: Counter[str]) -> None:
        self._name = name
        self._limit = limit
        self._timeout_s = timeout_s
        self._stats = stats
        self._answering = 0

    async def answer(self, stream: S, respond: Callable[[S], Awaitable[None]]) -> None:
        """`respond(stream)` reads the request and writes the reply; then the stream is
        closed (or reset, on any error from the other side or the deadline)."""
        if self._answering >= self._limit:
            self._stats[f"{self._name}_refused"] += 1
            await reset_quietly(stream)
            return
        self._answering += 1
        try:
            with trio.fail_after(self._timeout_s):
                await respond(stream)
                with contextlib.suppress(BaseLibp2pError):
                    await stream.close()
        except (trio.TooSlowError, RemoteProtocolError, WireError, BaseLibp2pError) as exc:
            self._stats[f"{self._name}_bad"] += 1
            logger.debug("%s: %s", self._name, exc)
            await reset_quietly(stream)
        finally:
            self._answering -= 1
