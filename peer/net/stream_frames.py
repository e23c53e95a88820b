"""One-request-per-stream helpers shared by the small protocols (load probes, roots);
the stream types are peer/net/streams.py's.

`read_frame` reads exactly one frame (protocols/framing.py) of at most `max_bytes`
(`read_frame_sized` also says how many bytes it read); `StreamRefused` says the stream
ended or failed before one arrived. `reset_quietly` resets a stream within a second,
whatever state it is in. Neither sets a deadline: the caller's `trio.fail_after` bounds
the wait (STYLE.md item 6). `BoundedAnswers` is the answering side's frame: at most
`limit` answers at once (beyond, a reset), each within `timeout_s`, a bad one reset.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from libp2p.exceptions import BaseLibp2pError

from peer.net.streams import StreamLike
from protocols.errors import RemoteProtocolError
from protocols.framing import FrameDecoder

__all__ = [
    "READ_BYTES",
    "BoundedAnswers",
    "StreamRefused",
    "read_frame",
    "read_frame_sized",
    "reset_quietly",
]

logger = logging.getLogger(__name__)
S = TypeVar("S", bound=StreamLike)

READ_BYTES = 65536  # one read: a whole small frame, or a large one in a few reads
RESET_TIMEOUT_S = 1.0  # a reset is one small write; a stalled peer must not hold us


class StreamRefused(Exception):
    """The peer could not be asked or did not answer properly."""


async def read_frame(stream: StreamLike, max_bytes: int) -> object:
    """The next frame's object; StreamRefused on end of stream or a failed read
    (RemoteProtocolError for a malformed or oversize frame)."""
    frame, _ = await read_frame_sized(stream, max_bytes)
    return frame


async def read_frame_sized(stream: StreamLike, max_bytes: int) -> tuple[object, int]:
    """`read_frame`, and the bytes read from the stream for it."""
    decoder = FrameDecoder(max_bytes)
    received = 0
    while True:
        frame = decoder.next_frame()
        if frame is not None:
            return frame, received
        try:
            data = await stream.read(READ_BYTES)
        except BaseLibp2pError as exc:
            raise StreamRefused(f"read failed: {exc!r}") from exc
        if not data:
            raise StreamRefused("end of stream")
        received += len(data)
        decoder.feed(data)


async def reset_quietly(stream: StreamLike) -> None:
    with trio.move_on_after(RESET_TIMEOUT_S) as scope:
        scope.shield = True
        with contextlib.suppress(BaseLibp2pError):
            await stream.reset()


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
        except (trio.TooSlowError, RemoteProtocolError, StreamRefused, BaseLibp2pError) as exc:
            self._stats[f"{self._name}_bad"] += 1
            logger.debug("%s: %s", self._name, exc)
            await reset_quietly(stream)
        finally:
            self._answering -= 1
