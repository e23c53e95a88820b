"""Cancellation that costs a stream, never its connection: two fixes to py-libp2p 0.8.1.

A peer cancels streams all the time: a probe round ends at its deadline, a race's losing
attempt is called off, a client goes away. Two places in py-libp2p turn such a
cancellation into damage beyond the stream.

**Noise writes** (`noise_write_*`). `BaseNoiseMsgReadWriter.write_msg` encrypts a message
(the session's nonce moves on) and then awaits the socket: the length-prefixed writer's
lock, then trio's `send_all`, both of which raise Cancelled at once in a cancelled
scope. Cancelled there, the write has used its nonce and sent nothing; the peer then
fails to authenticate the next message on that connection (`NoiseInvalidMessage`) and
drops the connection with every stream on it. A yamux frame's writer reaches that point
right after taking the connection's write lock, whose acquisition yields to the
scheduler, so a cancellation that arrives while it waits there is enough. Seen on the
testbed at d = 0, where `cost` probes most: forwards failed with "read failed:
StreamEOF" and "TCP connection reset by remote peer" in clusters, each costing its
request a retry. Measured on loopback (two hosts, rounds of 20 streams on one
connection, each cancelled within 4 ms of starting): the connection broke within two
rounds in each of 3 seeds without this fix, and ran 15 rounds clean in 3 of 3 with both
fixes. The fix: a write checks
for cancellation before encrypting (a cancelled writer sends nothing), then encrypts and
sends shielded, for at most `WRITE_TIMEOUT_S`; a write unfinished by then has used its
nonce and may have sent part of a message, so its connection is closed.

**Opening a yamux stream** (`open_stream_*`). `Yamux.open_stream` takes one of the
connection's 256 backlog slots, registers the stream, then sends its SYN; it gives the
slot back when that fails with an Exception, but Cancelled is not one. Each cancelled
open leaks a slot (and a stream entry) for the life of the connection; after 256 no
stream opens on it any more (the loopback test above with the Noise fix alone: every
slot gone and nothing opening after 13-14 rounds in 3 of 3 seeds). The fix opens the stream the same
way and, on any failure or cancellation, resets it (an RST, as its SYN may have gone
out) or, before it exists, gives the slot straight back.

Installed by peer/net/libp2p_fixes.py (WORKAROUND(noise-write), WORKAROUND(yamux-open)).
"""

from __future__ import annotations

import inspect
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import libp2p.stream_muxer.yamux.yamux as _yamux
import trio
from libp2p.exceptions import BaseLibp2pError
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.security.noise.io import BaseNoiseMsgReadWriter
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

__all__ = [
    "WRITE_TIMEOUT_S",
    "NoiseWriteTimeout",
    "atomic",
    "install_noise_write",
    "install_open_stream",
    "noise_write_installed",
    "noise_write_problem",
    "open_stream",
    "open_stream_installed",
    "open_stream_problem",
]

logger = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 10.0  # one message of at most 64 kB: milliseconds unless the peer stalled
CLEANUP_TIMEOUT_S = 2.0  # closing a socket, or an RST frame through a free connection
MARKER = "_prefixswarm_cancel_safe"
_ORIGINAL_WRITE = BaseNoiseMsgReadWriter.write_msg
_ORIGINAL_OPEN = Yamux.open_stream

WriteMsg = Callable[..., Awaitable[None]]
# what closing a connection or resetting a stream raises when the connection is going down
_CLOSING_ERRORS = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


# -- Noise writes ------------------------------------------------------------------------


class NoiseWriteTimeout(ConnectionClosedError):
    """A shielded Noise write did not finish in time; its connection was closed (callers
    that tell a closed connection by its type, as yamux does, see one)."""


def atomic(write_msg: WriteMsg, timeout_s: float = WRITE_TIMEOUT_S) -> WriteMsg:
    """`write_msg` (py-libp2p's signature) made whole under cancellation: see the module."""

    async def atomic_write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled already: nothing encrypted
        with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout_s) as scope:
            await write_msg(self, msg, prefix_encoded)
        if scope.cancelled_caught:
            logger.warning("a Noise write took over %.0f s: its connection is closed", timeout_s)
            with trio.CancelScope(shield=True, deadline=trio.current_time() + CLEANUP_TIMEOUT_S):
                try:
                    await self.close()
                except _CLOSING_ERRORS as exc:  # a broken socket's close: says nothing new
                    logger.debug("closing a connection after a stalled write: %r", exc)
            raise NoiseWriteTimeout(f"a Noise write took over {timeout_s:g} s")

    setattr(atomic_write_msg, MARKER, True)
    return atomic_write_msg


def install_noise_write() -> None:
    if not noise_write_installed():
        patched = atomic(_ORIGINAL_WRITE)
        BaseNoiseMsgReadWriter.write_msg = patched  # type: ignore[method-assign, assignment]


def noise_write_installed() -> bool:
    return bool(getattr(BaseNoiseMsgReadWriter.write_msg, MARKER, False))


def noise_write_problem() -> str | None:
    """Why the fix cannot go in (py-libp2p's writer is not the one it was written for)."""
    target = BaseNoiseMsgReadWriter.write_msg
    if getattr(target, MARKER, False):
        return None
    if target is not _ORIGINAL_WRITE:
        return "BaseNoiseMsgReadWriter.write_msg was replaced by something else"
    names = tuple(inspect.signature(target).parameters)
    if names != ("self", "msg", "prefix_encoded"):
        return f"BaseNoiseMsgReadWriter.write_msg takes {names}, not (self, msg, prefix_encoded)"
    if not callable(getattr(BaseNoiseMsgReadWriter, "close", None)):
        return "BaseNoiseMsgReadWriter has no close()"
    return None


# -- opening a yamux stream --------------------------------------------------------------


async def open_stream(self: Yamux) -> YamuxStream:
    """Yamux.open_stream that gives back what it took when it fails or is cancelled."""
    await self.stream_backlog_semaphore.acquire()  # cancelled here: nothing taken
    stream: YamuxStream | None = None
    try:
        async with self.streams_lock:
            if self.event_shutting_down.is_set():
                raise MuxedStreamError("Connection is shutting down")
            stream = YamuxStream(self.next_stream_id, self, True)
            self.next_stream_id += 2
            stream._owns_backlog_slot = True
            self.streams[stream.stream_id] = stream
            self.stream_buffers[stream.stream_id] = bytearray()
            self.stream_events[stream.stream_id] = trio.Event()
        syn = struct.pack(
            _yamux.YAMUX_HEADER_FORMAT, 0, _yamux.TYPE_WINDOW_UPDATE, _yamux.FLAG_SYN,
            stream.stream_id, 0,
        )
        await self._write_frame(syn)
    except BaseException as exc:
        await _give_back(self, stream)
        if isinstance(exc, Exception) and not isinstance(exc, MuxedStreamError):
            raise MuxedStreamError(f"Failed to send SYN: {exc}") from exc
        raise
    return stream


async def _give_back(conn: Yamux, stream: YamuxStream | None) -> None:
    """The backlog slot and the stream entry of an open that did not complete."""
    if stream is None:
        conn.stream_backlog_semaphore.release()
        return
    with trio.CancelScope(shield=True, deadline=trio.current_time() + CLEANUP_TIMEOUT_S):
        try:
            await stream.reset()  # its SYN may have gone out: the RST closes it there too
        except _CLOSING_ERRORS as exc:  # a connection going down: the slot is given back below
            logger.debug("resetting a stream whose open failed: %r", exc)
    if not stream._backlog_slot_released:  # the reset did not get that far
        stream._backlog_slot_released = True
        conn.stream_backlog_semaphore.release()
        for table in (conn.streams, conn.stream_buffers, conn.stream_events):
            table.pop(stream.stream_id, None)


def install_open_stream() -> None:
    if not open_stream_installed():
        Yamux.open_stream = open_stream  # type: ignore[method-assign]


def open_stream_installed() -> bool:
    return Yamux.open_stream is open_stream


def open_stream_problem() -> str | None:
    """Why the fix cannot go in: what of 0.8.1's yamux it relies on is not there."""
    if Yamux.open_stream is open_stream:
        return None
    if Yamux.open_stream is not _ORIGINAL_OPEN:
        return "Yamux.open_stream was replaced by something else"
    for name in ("YAMUX_HEADER_FORMAT", "TYPE_WINDOW_UPDATE", "FLAG_SYN"):
        if not hasattr(_yamux, name):
            return f"libp2p.stream_muxer.yamux.yamux has no {name}"
    source = inspect.getsource(Yamux.__init__) + inspect.getsource(YamuxStream.__init__)
    for name in ("stream_backlog_semaphore", "streams_lock", "event_shutting_down",
                 "next_stream_id", "stream_buffers", "stream_events", "_owns_backlog_slot",
                 "_backlog_slot_released"):
        if name not in source:
            return f"yamux no longer keeps {name}"
    if "_finalize_stream" not in inspect.getsource(YamuxStream.reset):
        return "YamuxStream.reset no longer gives its backlog slot back"
    return None
