"""Process-wide fixes to py-libp2p 0.8.1, applied once by `peer.host` on import.

Each is marked `WORKAROUND(n)` with n the number in /work/shared/notes/libp2p.md, or a
name for problems found in this project; `apply()` is idempotent.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

import libp2p.network.connection.swarm_connection as _libp2p_swarm_connection
import libp2p.network.swarm as _libp2p_swarm
import libp2p.pubsub.gossipsub as _libp2p_gossipsub
import libp2p.pubsub.pubsub as _libp2p_pubsub
import trio
from google.protobuf.message import DecodeError
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import Pubsub
from libp2p.stream_muxer.yamux.yamux import YamuxStream

__all__ = [
    "MAX_REMEMBERED_RECORDS",
    "SIGNED_RECORD_RECHECK_S",
    "WINDOW_GIVE_BACK_FRACTION",
    "apply",
]

logger = logging.getLogger(__name__)

RESET_TIMEOUT_S = 5.0  # resetting a stream is local work plus a best-effort frame
SIGNED_RECORD_RECHECK_S = 60.0  # an unchanged peer record is verified and stored again
#   this often (its addresses' TTL is 2 h): a peer's record changes only with its addresses
WINDOW_GIVE_BACK_FRACTION = 0.25  # of a yamux stream's window, consumed before it is given
#   back in one update: at least 192 kB stay open to the sender, 4x our largest message
#   (a writer that ran out of window mid-message could interleave with another's frames)
MAX_REMEMBERED_RECORDS = 1024  # (host, peer) pairs remembered: far more than a swarm's peers


def apply() -> None:
    """Process-wide fixes for py-libp2p 0.8.1; idempotent."""
    # WORKAROUND(1): every dial waits the full 250 ms happy-eyeballs head start even
    # when it succeeds (swarm.dial_peer uses this module global); 0 gives ~10 ms dials.
    _libp2p_swarm._HAPPY_EYEBALLS_DELAY = 0.0
    # WORKAROUND(logging): `import libp2p` sets propagate=False on the "libp2p" logger
    # with no handler, so its warnings go to Python's last-resort stderr handler and
    # bypass the application's logging configuration. Let them propagate instead;
    # LIBP2P_DEBUG (libp2p's own switch) keeps its handlers when set.
    if not os.environ.get("LIBP2P_DEBUG"):
        libp2p_logger = logging.getLogger("libp2p")
        libp2p_logger.propagate = True
        libp2p_logger.setLevel(logging.WARNING)
    # WORKAROUND(logging): the auto-connector forces its logger to INFO and then logs
    # "initiating 200 new dials" every 10 s while a swarm has < 50 connections.
    logging.getLogger("libp2p.network.auto_connector").setLevel(logging.WARNING)
    # WORKAROUND(logging): swarm_connection calls module-level `logging.debug(...)`,
    # which runs logging.basicConfig() on the root logger as a side effect (a stderr
    # handler appears in every program that uses us). Route it to a named logger.
    _libp2p_swarm_connection.logging = _NamedLogging(  # type: ignore[attr-defined,assignment]
        logging.getLogger(_libp2p_swarm_connection.__name__)
    )
    # WORKAROUND(pubsub-decode): Pubsub.continuously_read_stream parses every inbound RPC
    # with protobuf but does not catch DecodeError. One undecodable RPC from any remote
    # peer escapes the stream handler, fails the connection's task group and tears down
    # the whole host (seen: a peer's host dying mid-test). Reset that stream instead.
    if not getattr(Pubsub.continuously_read_stream, "_prefixswarm_guarded", False):
        Pubsub.continuously_read_stream = _guard_pubsub_reader(  # type: ignore[method-assign]
            Pubsub.continuously_read_stream
        )
    # WORKAROUND(signed-record): every pubsub RPC carries the sender's signed peer record,
    # and py-libp2p verifies and stores it again on every RPC, twice when the RPC holds
    # control messages (Pubsub's reader, then GossipSub.handle_rpc): an ed25519
    # verification, three protobuf parses and a rewrite of the peer's addresses each
    # time, most of gossip's CPU. A record byte-identical to the one last accepted from
    # the same peer within SIGNED_RECORD_RECHECK_S is accepted as before.
    # WORKAROUND(yamux-window): py-libp2p's yamux answers nearly every read with a
    # WINDOW_UPDATE frame (window auto-tuning, "release on read"): one more encrypted
    # frame and socket write per message received, ~13% of a gossiping peer's CPU in a
    # profile. go-yamux gives the window back once half of it was consumed; we do at a
    # quarter (WINDOW_GIVE_BACK_FRACTION) and keep the 256 kB window (no auto-tuning: our
    # frames are small).
    if not getattr(YamuxStream._auto_tune_and_send_window_update, "_prefixswarm", False):
        YamuxStream._auto_tune_and_send_window_update = (  # type: ignore[method-assign]
            _window_update_at_half
        )
    consume = getattr(_libp2p_pubsub, "maybe_consume_signed_record")  # noqa: B009
    if not getattr(consume, "_prefixswarm_memo", False):
        memo = _remember_signed_records(consume)
        for module in (_libp2p_pubsub, _libp2p_gossipsub):  # each imported the name
            setattr(module, "maybe_consume_signed_record", memo)  # noqa: B010


async def _window_update_at_half(self: YamuxStream, *, bytes_read: int = 0) -> None:
    async with self.window_lock:
        self._pending_recv_release += bytes_read
        pending: int = self._pending_recv_release
        if pending < self.target_recv_window * WINDOW_GIVE_BACK_FRACTION:
            return
        self._pending_recv_release = 0
        self.recv_window += pending
    await self.send_window_update(pending, skip_lock=True)


_window_update_at_half._prefixswarm = True  # type: ignore[attr-defined]


def _remember_signed_records(consume: Any, clock: Any = time.monotonic) -> Any:
    # (our host's id, the sender's id) -> (record bytes, when accepted); LRU-bounded
    accepted: OrderedDict[tuple[ID, ID], tuple[bytes, float]] = OrderedDict()

    def remembered(msg: Any, host: IHost, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        record: bytes = msg.senderRecord
        key = (host.get_id(), peer_id)
        now = clock()
        last = accepted.get(key)
        if last is not None and last[0] == record and now - last[1] < SIGNED_RECORD_RECHECK_S:
            return True
        ok: bool = consume(msg, host, peer_id)
        if ok:
            accepted[key] = (record, now)
            accepted.move_to_end(key)
            while len(accepted) > MAX_REMEMBERED_RECORDS:
                accepted.popitem(last=False)
        return ok

    remembered._prefixswarm_memo = True  # type: ignore[attr-defined]
    return remembered


def _guard_pubsub_reader(read_stream: Any) -> Any:
    async def guarded(self: Pubsub, stream: INetStream) -> None:
        try:
            await read_stream(self, stream)
        except (DecodeError, ValueError) as exc:
            peer = stream.muxed_conn.peer_id
            logger.warning("pubsub: undecodable RPC from %s (%s); resetting its stream", peer, exc)
            with trio.move_on_after(RESET_TIMEOUT_S):
                await _reset_quietly(stream)

    guarded._prefixswarm_guarded = True  # type: ignore[attr-defined]
    return guarded


async def _reset_quietly(stream: INetStream) -> None:
    try:
        await stream.reset()
    except BaseLibp2pError as exc:  # already reset or closed by the other side
        logger.debug("resetting stream: %s", exc)


class _NamedLogging:
    """Stands in for the `logging` module inside one libp2p module."""

    def __init__(self, named: logging.Logger) -> None:
        self.debug = named.debug
        self.info = named.info
        self.warning = named.warning
        self.error = named.error
        self.exception = named.exception

    def __getattr__(self, name: str) -> object:
        return getattr(logging, name)
