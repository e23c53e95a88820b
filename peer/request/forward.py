"""One attempt at a request: on the entry peer's engine, or forwarded to another peer.

An attempt is opened (`open`: up to its first token, under the caller's deadline), then
read (`next_tokens`: the next tokens, or `Finished` at the end) and closed (`aclose`,
always); a failure is an `AttemptFailed` carrying its `Outcome`. A request run
(peer/request/run.py) races openings (hedging) and streams the winner.

A forwarded attempt treats what the remote peer sends as data to check: token ids come
validated against the vocabulary (protocols/infer.py), more tokens than asked for are a
fault (`Faulty`), and the text, the serving peer's id and the timing are this peer's
own (the remote's text and `served_by` are never used).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from peer.engine.api import Completion, GeneratingEngine, SamplingParams, TokenEvent
from peer.net.wire import FrameStream, StreamOpener, WireError
from peer.request.admission import Admission, Overloaded, Slot
from peer.request.generation import Outcome
from peer.request.signed import answer_signed
from peer.swarm.peer_table import ForwardCharge, PeerTable
from protocols.answers import Evidence
from protocols.errors import RemoteProtocolError
from protocols.ids import INFER_PROTOCOL
from protocols.infer import (
    MAX_DEADLINE_S,
    ErrorCode,
    FinishReason,
    InferError,
    InferRequest,
    InferResult,
    TokenChunk,
    parse_response,
)

# Streams to a peer open within this; the first-token deadline covers the rest.
STREAM_OPEN_TIMEOUT_S = 10.0


def infer_request(
    request_id: str, prompt: Sequence[int], params: SamplingParams, time_left_s: float
) -> InferRequest:
    """A forward's wire form: the one place SamplingParams become InferRequest fields
    (peer/request/inference.py turns them back on the serving peer). ValueError if the wire
    cannot carry it (its bounds differ from the engine's)."""
    return InferRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        max_new_tokens=params.max_new_tokens,
        deadline_s=min(time_left_s, MAX_DEADLINE_S),
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        stop=params.stop,
        hops=1,
    )


@dataclass(frozen=True)
class Finished:
    """The end of an attempt's stream: why it finished ("stop" or "length")."""

    reason: str


# What reading an attempt gives: the next tokens, or the end.
Delivery = list[int] | Finished


class AttemptFailed(Exception):
    """The attempt ended without completing, with its ``outcome`` for the route."""

    def __init__(self, outcome: Outcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


class Faulty(AttemptFailed):
    """The remote peer broke the protocol's promises (e.g. more tokens than asked for):
    it is quarantined, not merely backed off."""

    def __init__(self, detail: str) -> None:
        super().__init__(Outcome.FAILED, detail)


class HedgeLost(AttemptFailed):
    """A later candidate delivered its first token first: this one was slower than its
    hedge delay, not stalled (its first-token deadline had not passed). Shown in the
    route and charged a fraction of a failure in the trust ledger (peer/routing/
    reliability.py: graded so that an occasional loss, as 2x-off estimates on busy CPUs
    cause, never demotes an honest peer), but neither backed off by the router nor
    reported to the requests waiting on it."""

    def __init__(self) -> None:
        super().__init__(Outcome.STALLED, "hedged: a later candidate answered first")


class MovedOn(AttemptFailed):
    """The peer failed for another request while this one waited on its first token:
    already recorded once, not a second failure."""

    def __init__(self) -> None:
        super().__init__(Outcome.STALLED, "failed meanwhile for a concurrent request")


class LocalAttempt:
    """The request on this peer's own engine, through the shared engine admission."""

    is_local = True

    def __init__(self, engine: GeneratingEngine, admission: Admission, prompt: list[int],
                 params: SamplingParams, cache_salt: bytes | None = None) -> None:
        self._engine = engine
        self._cache_salt = cache_salt
        self._admission = admission
        self._prompt = prompt
        self._params = params
        self._slot: Slot | None = None
        self._agen: AsyncIterator[TokenEvent | Completion] | None = None
        self.cached_tokens: int | None = None
        self.first: list[int] = []

    async def open(self, first_token_s: float = math.inf) -> None:
        """Admit and start the request here (no first-token deadline: never hedged)."""
        try:
            self._slot = self._admission.admit()
        except Overloaded as exc:
            raise AttemptFailed(Outcome.REFUSED, str(exc)) from exc
        if self._cache_salt is None:
            self._agen = self._engine.stream(self._prompt, self._params)
        else:
            self._agen = self._engine.stream(
                self._prompt, self._params, cache_salt=self._cache_salt
            )
        first = await self.next_tokens()
        if isinstance(first, Finished):
            raise AttemptFailed(Outcome.FAILED, "the engine finished without a token")
        self.first = first

    async def next_tokens(self) -> Delivery:
        assert self._agen is not None, "open() first"
        async for item in self._agen:
            if isinstance(item, TokenEvent):
                return [item.token_id]
            if isinstance(item, Completion):
                self.cached_tokens = item.usage.cached_tokens
                return Finished(item.finish_reason)
        raise AttemptFailed(Outcome.FAILED, "the engine ended without a completion")

    async def aclose(self) -> None:
        aclose = getattr(self._agen, "aclose", None)  # an async generator's, to release it
        if aclose is not None:
            with trio.CancelScope(shield=True):
                await aclose()
        if self._slot is not None:
            self._slot.release()
            self._slot = None


class RemoteAttempt:
    """The request forwarded to ``peer_id`` over /prefixswarm/infer (one stream).

    Raises AttemptFailed at once if the wire cannot carry the request."""

    is_local = False

    def __init__(
        self,
        *,
        host: StreamOpener,
        table: PeerTable,
        peer_id: str,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        vocab_size: int,
        gap_s: float,
        deadline: float = float("inf"),
    ) -> None:
        try:
            self._request = infer_request(
                request_id, prompt, params, deadline - trio.current_time()
            )
        except ValueError as exc:  # the engine accepts more than the wire carries
            raise AttemptFailed(Outcome.FAILED, f"cannot be forwarded: {exc}") from exc
        self._host = host
        self._table = table
        self.peer_id = peer_id
        self._vocab_size = vocab_size
        self._gap_s = gap_s
        self._deadline = deadline  # the request's end-to-end deadline
        self._frames: FrameStream | None = None
        self._charge: ForwardCharge | None = None
        self._got_first = False
        self.answer: list[int] = []  # every token received, for the signature's check
        self.signature = b""
        self.finish_reason: FinishReason | None = None
        self._finished = False
        self.received = 0  # token ids received so far
        self.cached_tokens: int | None = None
        self.first: list[int] = []
        self.direct = False  # sent on a connection already held (a lazy stream)
        self.sent_at: float | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.delivered_at: float | None = None  # its first token reached the client
        self.server_ttft_s: float | None = None  # the serving engine's, as its result says

    async def open(self, first_token_s: float = math.inf) -> None:
        """Open the stream (within STREAM_OPEN_TIMEOUT_S), send the request, and wait for
        the first token at most `first_token_s` after it was sent (STALLED past it), all
        within the caller's deadline. The first-token clock starts at the request: a
        stream that must dial or cross a relay first is not charged its setup."""
        now = trio.current_time()
        self._charge = self._table.record_forward(
            self.peer_id, len(self._request.prompt_token_ids), now
        )
        with self._errors():
            stream = await self._host.new_stream(
                ID.from_base58(self.peer_id), [INFER_PROTOCOL], timeout_s=STREAM_OPEN_TIMEOUT_S,
                lazy=True,
            )
            self._frames = FrameStream(stream)
            self.direct = bool(getattr(stream, "direct", False))  # LazyStream.direct
            self.sent_at = trio.current_time()
            with trio.move_on_after(first_token_s) as timer:
                await self._first_token(self._frames)
            if timer.cancelled_caught:
                raise AttemptFailed(Outcome.STALLED, f"no first token in {first_token_s:.3f} s")
            self.first_at = self.last_at = trio.current_time()
            self._got_first = True
            if self._charge is not None:
                self._table.forward_prefilled(self._charge)

    async def _first_token(self, frames: FrameStream) -> None:
        await frames.send(self._request)
        while not self.first:
            message = parse_response(await frames.receive(), self._vocab_size)
            if isinstance(message, TokenChunk):
                self.first = self._take(message)
            elif isinstance(message, InferResult):
                raise Faulty("finished without sending a token")
            else:
                raise _remote_error(message)

    async def next_tokens(self) -> Delivery:
        """The next tokens, or Finished; each read within the token gap."""
        assert self._frames is not None, "open() first"
        with self._errors():
            while True:
                with trio.fail_at(min(self._deadline, trio.current_time() + self._gap_s)):
                    message = parse_response(await self._frames.receive(), self._vocab_size)
                if isinstance(message, TokenChunk):
                    tokens = self._take(message)
                    if tokens:
                        self.last_at = trio.current_time()
                        return tokens
                elif isinstance(message, InferResult):
                    sent = len(self._request.prompt_token_ids)
                    if message.cached_tokens > sent:  # reaches the client as usage: checked
                        raise Faulty(
                            f"claims {message.cached_tokens} cached tokens of a {sent}-token "
                            "prompt"
                        )
                    if not answer_signed(self.peer_id, self._request, self.answer, message):
                        raise Faulty("its answer is not signed with its own key")
                    self.cached_tokens = message.cached_tokens
                    self.server_ttft_s = message.ttft_s
                    self.signature = message.signature
                    self.finish_reason = message.finish_reason
                    self._finished = True
                    return Finished(message.finish_reason.value)
                else:
                    raise _remote_error(message)

    def _take(self, chunk: TokenChunk) -> list[int]:
        """The chunk's token ids, checked against what was asked for (ids are checked
        against the vocabulary when the frame is parsed)."""
        self.received += len(chunk.token_ids)
        asked = self._request.max_new_tokens
        if self.received > asked:
            raise Faulty(f"sent {self.received} tokens, more than the {asked} asked for")
        self.answer.extend(chunk.token_ids)
        return list(chunk.token_ids)

    def evidence(self) -> Evidence | None:
        """The peer's signed answer to this request, for others to re-score (None until
        its signed result came)."""
        if not self.signature or self.finish_reason is None or not self.answer:
            return None
        return Evidence(
            self.peer_id, self._request, tuple(self.answer), self.finish_reason, self.signature
        )

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except trio.TooSlowError as exc:
            raise AttemptFailed(Outcome.STALLED, "no token before the deadline") from exc
        except (WireError, RemoteProtocolError) as exc:
            raise AttemptFailed(Outcome.FAILED, str(exc) or type(exc).__name__) from exc

    async def aclose(self) -> None:
        if self._charge is not None:
            self._table.forward_ended(self._charge, prefilled=self._got_first)
            self._charge = None
        if self._frames is not None:
            frames, self._frames = self._frames, None
            await frames.reset()  # done or abandoned: the serving peer stops either way


def _remote_error(error: InferError) -> AttemptFailed:
    if error.code is ErrorCode.INVALID_REQUEST:
        # Validated here with the same rules: the peer disagrees, so it is faulty.
        return AttemptFailed(Outcome.FAILED, f"peer rejected a valid request: {error.message}")
    if error.code is ErrorCode.DEADLINE:
        return AttemptFailed(Outcome.STALLED, f"peer ran out of time: {error.message}")
    return AttemptFailed(Outcome.REFUSED, f"{error.code.value}: {error.message}")
