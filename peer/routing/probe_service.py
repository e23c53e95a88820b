"""The load-probe protocol's shell: ask peers for their load, and answer when asked.

`probe_loads` runs one `ProbeRound` (peer/routing/probing.py decided whom and how long): one
stream per probed peer, all at once, each sending a `LoadQuery` and reading one
`LoadReport`; it returns when every peer answered or at the round's deadline, whichever
comes first, and resets whatever is still open. A peer that cannot be reached, refuses
the protocol, sends garbage or answers late is simply ranked on its gossiped load.

`LoadService` answers: one small frame in, one out, within LOAD_ANSWER_TIMEOUT_S, at most
MAX_ANSWERING at once (beyond that a query is reset: a flood must not cost more than a
reset each). It runs in libp2p's handler task, which its deadline bounds.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from peer.engine.api import EngineView
from peer.net.wire import (
    BoundedAnswers,
    HandlerHost,
    PeerUnreachable,
    StreamLike,
    StreamOpener,
    WireError,
    read_frame,
    reset_quietly,
)
from peer.routing.probing import ProbeRound
from protocols.errors import RemoteProtocolError
from protocols.framing import encode_frame
from protocols.ids import LOAD_PROTOCOL
from protocols.load import (
    MAX_LOAD_FRAME_BYTES,
    LoadQuery,
    LoadReport,
    decode_load_query,
    decode_load_report,
)

logger = logging.getLogger(__name__)

LOAD_ANSWER_TIMEOUT_S = 2.0  # a query is one tiny frame sent right after opening
MAX_ANSWERING = 64  # concurrent answers; each is ~1 ms of work, more is a flood


async def probe_loads(
    host: StreamOpener, probe: ProbeRound, stats: Counter[str] | None = None
) -> dict[str, LoadReport]:
    """Ask every peer of ``probe.plan`` at once; the reports kept by its deadline."""
    stats = stats if stats is not None else Counter()

    async def ask(peer_id: str, done: Callable[[], None]) -> None:
        stream = None
        try:
            stream = await host.new_stream(
                ID.from_base58(peer_id),
                [LOAD_PROTOCOL],
                timeout_s=max(0.0, probe.deadline - trio.current_time()),
            )
            await stream.write(encode_frame(LoadQuery().to_wire()))
            report = decode_load_report(await read_frame(stream, MAX_LOAD_FRAME_BYTES))
        except (WireError, BaseLibp2pError, RemoteProtocolError) as exc:
            stats["probe_refused"] += 1
            logger.debug("load probe of %s: %s", peer_id, exc)
            return
        finally:
            if stream is not None:
                await reset_quietly(stream)
        if probe.offer(peer_id, report, trio.current_time()) and probe.done:
            done()

    stats["probe_rounds"] += 1
    stats["probes_sent"] += len(probe.plan.peers)
    with trio.move_on_at(probe.deadline):
        async with trio.open_nursery() as nursery:
            for peer_id in probe.plan.peers:
                nursery.start_soon(ask, peer_id, nursery.cancel_scope.cancel)
    stats["probe_answered"] += len(probe.reports)
    stats["probe_unanswered"] += len(probe.plan.peers) - len(probe.reports)
    return dict(probe.reports)


async def query_model(host: StreamOpener, peer_id: str, model_id: str, timeout_s: float) -> str:
    """The model id `peer_id` serves ('' when it does not say), telling it ours; raises
    PeerUnreachable, StreamRefused or RemoteProtocolError (libp2p's errors too)."""
    stream = await host.new_stream(ID.from_base58(peer_id), [LOAD_PROTOCOL], timeout_s=timeout_s)
    try:
        with trio.fail_after(timeout_s):
            await stream.write(encode_frame(LoadQuery(model_id=model_id).to_wire()))
            report = decode_load_report(await read_frame(stream, MAX_LOAD_FRAME_BYTES))
    except trio.TooSlowError:
        raise PeerUnreachable(f"{peer_id} did not answer a load query in {timeout_s:g} s") from None
    finally:
        await reset_quietly(stream)
    return report.model_id


class LoadService:
    """Answers /prefixswarm/load/1.0.0 with the engine's load now."""

    def __init__(self, engine: EngineView) -> None:
        self._engine = engine
        self.stats: Counter[str] = Counter()
        self._answers = BoundedAnswers(
            "load_queries", MAX_ANSWERING, LOAD_ANSWER_TIMEOUT_S, self.stats
        )

    async def handle_stream(self, stream: StreamLike) -> None:
        """libp2p's stream handler: one query, one report, within the deadline."""
        await self._answers.answer(stream, self._respond)

    async def _respond(self, stream: StreamLike) -> None:
        query = decode_load_query(await read_frame(stream, MAX_LOAD_FRAME_BYTES))
        ours = self._engine.model_id
        if query.model_id and query.model_id != ours:
            self.stats["load_queries_other_model"] += 1
            logger.warning(
                "a peer serving %s asked for this peer's load; this peer serves %s: peers "
                "of different models (or weights, or dtype) cannot share a swarm",
                query.model_id, ours,
            )
        load = self._engine.load()
        report = LoadReport(
            queued_prompt_tokens=load.queued_prompt_tokens,
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            model_id=ours,
        )
        await stream.write(encode_frame(report.to_wire()))
        self.stats["load_queries_answered"] += 1

    def serve(self, host: HandlerHost) -> None:
        """Register the handler on the libp2p host."""
        host.set_stream_handler(TProtocol(LOAD_PROTOCOL), self.handle_stream)

    def statistics(self) -> dict[str, int]:
        return dict(self.stats)
