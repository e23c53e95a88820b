"""The serving side of the inference protocol (protocols/infer.py over peer/net/wire.py).

`InferenceService` serves forwarded requests: it owns every inbound request in its own
nursery (libp2p's handler only hands the stream over), refuses peers this one quarantined
(`refused`), bounds the requests in flight per remote peer and charges each to the remote
budget (peer/request/budget.py: `over_budget` when a share is spent), runs them on the
local engine through the shared `Admission` (a stranger's, from a peer this one does not
trust yet, behind this peer's own clients' requests: `background`; a trusted peer's
forwards are its clients' requests too, and queue beside ours), streams tokens back,
and stops generating as soon as the entry peer goes away (a reader watches the stream
while the engine runs).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
from libp2p.custom_types import TProtocol

from peer.engine.api import (
    Completion,
    EngineError,
    GeneratingEngine,
    InvalidRequest,
    SamplingParams,
    TokenEvent,
)
from peer.net.wire import FrameStream, HandlerHost, InboundStream, StreamBroken, reset_quietly
from peer.request.admission import Admission, Overloaded
from peer.request.budget import OverBudget, RemoteBudget, request_cost_s
from peer.request.served_log import ServedLog
from peer.request.signed import Signer, sign_answer
from protocols.errors import RemoteProtocolError
from protocols.ids import INFER_PROTOCOL
from protocols.infer import (
    ErrorCode,
    FinishReason,
    InferError,
    InferRequest,
    InferResult,
    TokenChunk,
    parse_request,
)
from protocols.served import prompt_digest

if TYPE_CHECKING:  # trio's TaskStatus, as the trio-stubs py-libp2p pulls in type it
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

REQUEST_READ_TIMEOUT_S = 10.0  # an entry peer sends its request right after opening
REPLY_WRITE_TIMEOUT_S = 10.0  # a reader that stops reading for this long is gone
INBOUND_BACKLOG = 64  # streams handed over but not yet started; beyond it: refused


class Served(enum.Enum):
    """How an inbound request ended (a statistics key)."""

    SERVED = "served"
    ENTRY_LEFT = "cancelled_by_entry"
    INVALID = "rejected_invalid"
    FAILED = "failed_internal"


def finish_reason(text: str) -> FinishReason:
    return FinishReason.LENGTH if text == "length" else FinishReason.STOP


class InferenceService:
    """Serves /prefixswarm/infer/1.0.0 for requests forwarded by other peers."""

    def __init__(
        self,
        engine: GeneratingEngine,
        admission: Admission,
        *,
        self_id: str,
        max_inbound_per_peer: int,
        budget: RemoteBudget | None = None,
        refuses: Callable[[str], bool] = lambda peer_id: False,
        trusted: Callable[[str], bool] = lambda peer_id: False,
        sign: Signer | None = None,
        served_log: ServedLog | None = None,
    ) -> None:
        self._engine = engine
        self._served_log = served_log  # who asked for which prompt (protocols/served.py)
        self._admission = admission
        self._self_id = self_id
        self._max_per_peer = max_inbound_per_peer
        self.budget = budget or RemoteBudget()
        self._refuses = refuses  # whether a peer is served no more (quarantined here)
        self._trusted = trusted  # whether a peer's requests queue beside our clients'
        self._sign = sign  # signs every answer (None: unsigned, which entries refuse)
        self._per_peer: Counter[str] = Counter()
        self._leaving = False
        self._send, self._receive = trio.open_memory_channel[tuple[InboundStream, str]](
            INBOUND_BACKLOG
        )
        self.stats: Counter[str] = Counter()

    def stop_accepting(self) -> None:
        """Refuse new requests from now on ('overloaded: leaving', so the entry peer tries
        its next candidate); those already running go on."""
        self._leaving = True

    @property
    def in_flight(self) -> int:
        """Forwarded requests running here now."""
        return sum(self._per_peer.values())

    async def handle_stream(self, stream: InboundStream) -> None:
        """libp2p's stream handler: hand the stream to our nursery, refuse if backlogged."""
        remote = stream.muxed_conn.peer_id.to_base58()
        try:
            self._send.send_nowait((stream, remote))
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.stats["refused_backlog"] += 1
            await reset_quietly(stream)

    async def serve(
        self, host: HandlerHost, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Register the handler and serve inbound requests until cancelled."""
        async with trio.open_nursery() as nursery, self._receive:
            host.set_stream_handler(TProtocol(INFER_PROTOCOL), self.handle_stream)
            task_status.started()
            try:
                async for stream, remote in self._receive:
                    nursery.start_soon(self._serve_one, stream, remote)
            finally:
                self._send.close()

    async def _serve_one(self, stream: InboundStream, remote: str) -> None:
        frames = FrameStream(stream)
        try:
            with trio.fail_after(REQUEST_READ_TIMEOUT_S):
                request = parse_request(await frames.receive(), self._engine.vocab_size)
        except (RemoteProtocolError, StreamBroken, trio.TooSlowError) as exc:
            self.stats["rejected_invalid"] += 1
            logger.info("bad inference request from %s: %s", remote, exc)
            await self._reply_error(frames, ErrorCode.INVALID_REQUEST, str(exc))
            await frames.close()
            return
        if self._leaving:
            self.stats["refused_leaving"] += 1
            await self._reply_error(frames, ErrorCode.OVERLOADED, "this peer is leaving")
            await frames.close()
            return
        if self._refuses(remote):
            self.stats["refused_quarantined"] += 1
            await self._reply_error(
                frames, ErrorCode.REFUSED, "this peer quarantined you and serves you no more"
            )
            await frames.close()
            return
        if self._per_peer[remote] >= self._max_per_peer:
            self.stats["refused_per_peer"] += 1
            await self._reply_error(
                frames,
                ErrorCode.OVERLOADED,
                f"at most {self._max_per_peer} requests in flight per peer",
            )
            await frames.close()
            return
        load = self._engine.load()
        cost = request_cost_s(
            len(request.prompt_token_ids), request.max_new_tokens,
            load.prefill_tokens_per_s, load.decode_tokens_per_s,
        )
        idle = load.running_requests == 0 and load.waiting_requests == 0
        charge = self.budget.admit(remote, cost, trio.current_time(), idle=idle)
        if isinstance(charge, OverBudget):
            self.stats["refused_over_budget"] += 1
            await self._reply_error(
                frames, ErrorCode.OVER_BUDGET,
                f"{charge.reason}; retry after {charge.retry_after_s:.2f} s",
            )
            await frames.close()
            return
        if self._served_log is not None:
            self._served_log.record(
                prompt_digest(request.prompt_token_ids), remote, trio.current_time()
            )
        self._per_peer[remote] += 1
        try:
            await self._run(frames, request, background=not self._trusted(remote))
        finally:
            self.budget.release(charge)
            self._per_peer[remote] -= 1
            if not self._per_peer[remote]:
                del self._per_peer[remote]
            await frames.close()

    async def _run(self, frames: FrameStream, request: InferRequest, *, background: bool) -> None:
        params = SamplingParams(
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop,
        )
        try:
            slot = self._admission.admit()
        except Overloaded as exc:
            self.stats["refused_overloaded"] += 1
            await self._reply_error(frames, ErrorCode.OVERLOADED, str(exc))
            return
        with slot, trio.move_on_after(request.deadline_s) as deadline:
            status = await self._stream_tokens(frames, request, params, background)
            self.stats["served_background" if background else "served_trusted"] += 1
            self.stats[status.value] += 1
        if deadline.cancelled_caught:
            self.stats["deadline"] += 1
            await self._reply_error(frames, ErrorCode.DEADLINE, "deadline passed while serving")

    async def _stream_tokens(
        self, frames: FrameStream, request: InferRequest, params: SamplingParams,
        background: bool,
    ) -> Served:
        """Stream the generation back; every failure becomes a status and, where the entry
        peer can still hear it, an error frame. Nothing escapes to the service."""
        status = Served.ENTRY_LEFT  # unless the stream finishes or fails first
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_entry, frames, nursery.cancel_scope)
            try:
                await self._send_generation(frames, request, params, background)
                status = Served.SERVED
            except InvalidRequest as exc:  # valid on the wire, not for this model
                status = Served.INVALID
                await self._reply_error(frames, ErrorCode.INVALID_REQUEST, str(exc))
            except (StreamBroken, trio.TooSlowError):  # the entry peer stopped reading
                status = Served.ENTRY_LEFT
            except (EngineError, RuntimeError) as exc:  # torch reports failures as RuntimeError
                logger.exception("request %s failed in the engine", request.request_id)
                status = Served.FAILED
                await self._reply_error(frames, ErrorCode.INTERNAL, f"engine failed: {exc}")
            nursery.cancel_scope.cancel()
        return status

    async def _send_generation(
        self, frames: FrameStream, request: InferRequest, params: SamplingParams,
        background: bool,
    ) -> None:
        agen = self._engine.stream(request.prompt_token_ids, params, background=background)
        async with contextlib.aclosing(agen):
            async for item in agen:
                if isinstance(item, TokenEvent):
                    with trio.fail_after(REPLY_WRITE_TIMEOUT_S):
                        await frames.send(TokenChunk((item.token_id,), item.text))
                elif isinstance(item, Completion):
                    usage = item.usage
                    finish = finish_reason(item.finish_reason)
                    signature = b"" if self._sign is None else sign_answer(
                        self._sign, self._self_id, request, item.token_ids, finish
                    )
                    result = InferResult(
                        prompt_tokens=usage.prompt_tokens,
                        cached_tokens=usage.cached_tokens,
                        completion_tokens=usage.completion_tokens,
                        ttft_s=usage.ttft_s,
                        decode_tokens_per_s=usage.decode_tokens_per_s,
                        total_s=usage.total_s,
                        finish_reason=finish,
                        served_by=self._self_id,
                        signature=signature,
                    )
                    with trio.fail_after(REPLY_WRITE_TIMEOUT_S):
                        await frames.send(result)

    async def _watch_entry(self, frames: FrameStream, scope: trio.CancelScope) -> None:
        """The entry peer sends nothing after its request: any read end means it left."""
        with contextlib.suppress(RemoteProtocolError, StreamBroken):
            await frames.receive()
        scope.cancel()

    async def _reply_error(self, frames: FrameStream, code: ErrorCode, message: str) -> None:
        with trio.move_on_after(REPLY_WRITE_TIMEOUT_S) as scope:
            scope.shield = True
            with contextlib.suppress(StreamBroken):
                await frames.send(InferError.truncated(code, message))

    def statistics(self) -> dict[str, int]:
        stats = dict(self.stats)
        stats["inbound_in_flight"] = sum(self._per_peer.values())
        stats.update(self.budget.statistics())
        return stats
