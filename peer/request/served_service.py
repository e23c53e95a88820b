"""The served-for protocol's shell (protocols/served.py): answer from this peer's
ServedLog, and ask other peers whether a probation peer obtained an answer from them.

`ServedService` answers one query per stream, within SERVED_ANSWER_TIMEOUT_S, at most
MAX_ANSWERING at once (a flood costs a reset each). `served_elsewhere` asks a few peers
at once and returns the first that says yes, or None when none did by its deadline: a
peer that cannot be reached, refuses the protocol or answers garbage says nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from peer.net.wire import (
    BoundedAnswers,
    HandlerHost,
    StreamLike,
    StreamOpener,
    WireError,
    read_frame,
    reset_quietly,
)
from peer.request.served_log import ServedLog
from protocols.errors import RemoteProtocolError
from protocols.framing import encode_frame
from protocols.ids import SERVED_PROTOCOL
from protocols.served import (
    MAX_SERVED_FRAME_BYTES,
    ServedQuery,
    ServedReply,
    decode_served_query,
    decode_served_reply,
)

logger = logging.getLogger(__name__)

SERVED_ANSWER_TIMEOUT_S = 2.0  # a query is one tiny frame sent right after opening
MAX_ANSWERING = 16  # concurrent answers; each is a dictionary lookup


class ServedService:
    """Answers /prefixswarm/served/1.0.0 from `log`."""

    def __init__(self, log: ServedLog) -> None:
        self._log = log
        self.stats: Counter[str] = Counter()
        self._answers = BoundedAnswers(
            "served_queries", MAX_ANSWERING, SERVED_ANSWER_TIMEOUT_S, self.stats
        )

    async def handle_stream(self, stream: StreamLike) -> None:
        """libp2p's stream handler: one query, one reply, within the deadline."""
        await self._answers.answer(stream, self._respond)

    async def _respond(self, stream: StreamLike) -> None:
        query = decode_served_query(await read_frame(stream, MAX_SERVED_FRAME_BYTES))
        asked = self._log.asked(query.digest, query.requester, trio.current_time())
        await stream.write(encode_frame(ServedReply(asked).to_wire()))
        self.stats["served_queries_answered"] += 1
        self.stats["served_queries_yes"] += asked

    def serve(self, host: HandlerHost) -> None:
        """Register the handler on the libp2p host."""
        host.set_stream_handler(TProtocol(SERVED_PROTOCOL), self.handle_stream)

    def statistics(self) -> dict[str, int]:
        return dict(self.stats)


async def served_elsewhere(
    host: StreamOpener, peers: Sequence[str], query: ServedQuery, timeout_s: float,
    stats: Counter[str] | None = None,
) -> str | None:
    """The first of `peers` to say that `query.requester` asked it for the prompt, or
    None if none did within `timeout_s`."""
    stats = stats if stats is not None else Counter()
    said_yes: list[str] = []

    async def ask(peer_id: str, done: trio.CancelScope) -> None:
        stream = None
        try:
            stream = await host.new_stream(ID.from_base58(peer_id), [SERVED_PROTOCOL],
                                           timeout_s=timeout_s)
            await stream.write(encode_frame(query.to_wire()))
            reply = decode_served_reply(await read_frame(stream, MAX_SERVED_FRAME_BYTES))
        except (WireError, BaseLibp2pError, RemoteProtocolError) as exc:
            stats["served_query_failed"] += 1
            logger.debug("served query to %s: %s", peer_id, exc)
            return
        finally:
            if stream is not None:
                await reset_quietly(stream)
        if reply.asked:
            said_yes.append(peer_id)
            done.cancel()

    stats["served_queries_sent"] += len(peers)
    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for peer_id in peers:
                nursery.start_soon(ask, peer_id, nursery.cancel_scope)
    return said_yes[0] if said_yes else None
