"""One-request-per-stream helpers shared by the small protocols (load probes, roots).

`read_frame` reads exactly one frame (protocols/framing.py) of at most `max_bytes`
(`read_frame_sized` also says how many bytes it read); `StreamRefused` says the stream
ended or failed before one arrived. `reset_quietly` resets a stream within a second,
whatever state it is in. Neither sets a deadline: the caller's `trio.fail_after` bounds
the wait (STYLE.md item 6).
"""

from __future__ import annotations

import contextlib
from typing import Any

import trio
from libp2p.exceptions import BaseLibp2pError

from protocols.framing import FrameDecoder

__all__ = ["READ_BYTES", "StreamRefused", "read_frame", "read_frame_sized", "reset_quietly"]

READ_BYTES = 65536  # one read: a whole small frame, or a large one in a few reads
RESET_TIMEOUT_S = 1.0  # a reset is one small write; a stalled peer must not hold us


class StreamRefused(Exception):
    """The peer could not be asked or did not answer properly."""


async def read_frame(stream: Any, max_bytes: int) -> object:
    """The next frame's object; StreamRefused on end of stream or a failed read
    (RemoteProtocolError for a malformed or oversize frame)."""
    frame, _ = await read_frame_sized(stream, max_bytes)
    return frame


async def read_frame_sized(stream: Any, max_bytes: int) -> tuple[object, int]:
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


async def reset_quietly(stream: Any) -> None:
    with trio.move_on_after(RESET_TIMEOUT_S) as scope:
        scope.shield = True
        with contextlib.suppress(BaseLibp2pError):
            await stream.reset()
