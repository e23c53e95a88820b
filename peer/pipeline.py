"""The entry peer's request path: admit, route, forward or run locally, fall back.

Like happy eyeballs (STYLE.md item 5): the router ranks candidates; each is tried in
turn until one completes the request. A candidate that fails, refuses or stalls before
its first token is abandoned for the next; one that fails after streaming tokens hands
over to the next with the prompt plus the tokens so far (greedy output stays identical).
The entry peer itself is always among the candidates, so the request completes if this
peer can run it. One `RequestFailed` at the end carries every attempt's cause.

Cancel scopes never span a `yield` here: each await has its own deadline, so a slow
consumer (an HTTP client) is never blamed for a slow peer, nor the reverse.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import trio
from libp2p.peer.id import ID

from peer.admission import Admission, Overloaded
from peer.config import PeerConfig
from peer.engine.api import Completion, SamplingParams, TokenEvent
from peer.host import PeerUnreachable
from peer.inference import FrameStream, StreamBroken
from peer.router import Candidate, LocalState, Router
from protocols.errors import RemoteProtocolError
from protocols.ids import INFER_PROTOCOL
from protocols.infer import (
    MAX_DEADLINE_S,
    ErrorCode,
    InferError,
    InferRequest,
    InferResult,
    TokenChunk,
)

logger = logging.getLogger(__name__)
ROUTE_LOG_CANDIDATES = 3  # the candidates a DEBUG log line explains, best first

# Streams to a peer open within this; the first-token deadline covers the rest.
STREAM_OPEN_TIMEOUT_S = 10.0
# The time left that a forward must at least have: below it, running locally is better.
MIN_FORWARD_BUDGET_S = 0.05


class RequestFailed(Exception):
    """No candidate completed the request; `attempts` says what happened with each."""

    def __init__(self, message: str, attempts: Sequence[Attempt]) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


class DeadlineExceeded(RequestFailed):
    """The request's end-to-end deadline passed."""


class Outcome(enum.Enum):
    OK = "ok"
    REFUSED = "refused"  # the peer answered with a retryable error (e.g. overloaded)
    FAILED = "failed"  # unreachable, broken stream, protocol error
    STALLED = "stalled"  # no first token / no next token in time
    HANDED_OVER = "handed_over"  # failed after streaming tokens; the next one continues


@dataclass(frozen=True)
class Attempt:
    peer_id: str
    is_local: bool
    outcome: Outcome
    detail: str
    tokens: int  # tokens this attempt contributed


@dataclass(frozen=True)
class GenerationChunk:
    """Tokens produced since the last chunk and their text."""

    token_ids: tuple[int, ...]
    text: str
    served_by: str


@dataclass(frozen=True)
class GenerationResult:
    """A finished request, whichever peer(s) served it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # reused by the peer that computed the prompt's first token
    completion_tokens: int
    ttft_s: float  # at the entry peer, from admission to the first token
    total_s: float
    served_by: str  # the peer that produced the last token
    route: tuple[Attempt, ...]


class _AttemptFailed(Exception):
    def __init__(self, outcome: Outcome, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


@dataclass
class _Progress:
    """What the request has so far, across attempts."""

    generated: list[int]
    texts: list[str]
    first_token_at: float | None = None
    cached_tokens: int | None = None
    served_by: str = ""
    handovers: int = 0  # attempts that streamed tokens and then failed


class Pipeline:
    """Entry-side routing of requests over the swarm."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        engine: Any,
        router: Router,
        table: Any,
        host: Any,
        admission: Admission,
        self_id: str,
    ) -> None:
        self._config = config
        self._engine = engine
        self.router = router
        self._table = table
        self._host = host
        self._admission = admission
        self._entry = Admission(config.max_queue * 4, name="entry queue")
        self._self_id = self_id
        self.stats: Counter[str] = Counter()

    # -- the public path ----------------------------------------------------------------

    async def stream(
        self,
        token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[GenerationChunk | GenerationResult, None]:
        """Chunks as tokens arrive, then one GenerationResult.

        Raises InvalidRequest (bad input, before anything runs), Overloaded (this peer
        holds too many requests), DeadlineExceeded or RequestFailed.
        """
        tokens = self._engine.validate(token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        try:
            slot = self._entry.admit()
        except Overloaded:
            self.stats["overloaded"] += 1
            raise
        with slot:
            self.stats["requests"] += 1
            start = trio.current_time()
            deadline = start + (timeout_s or self._config.request_timeout_s)
            progress = _Progress([], [])
            route: list[Attempt] = []
            candidates = self._rank(tokens, params, start)
            for candidate in candidates:
                remaining = params.max_new_tokens - len(progress.generated)
                if remaining <= 0:  # the stream broke after the last token, before the result
                    yield self._result(request_id, tokens, progress, "length", start, route)
                    return
                left = deadline - trio.current_time()
                if left <= 0:
                    break
                if not candidate.is_local and left < MIN_FORWARD_BUDGET_S:
                    continue
                before = len(progress.generated)
                sub_params = replace(params, max_new_tokens=remaining)
                prompt = tokens + progress.generated
                try:
                    if candidate.is_local:
                        attempt = self._run_local(prompt, sub_params, progress)
                    else:
                        attempt = self._forward(
                            candidate, prompt, sub_params, request_id, deadline, progress
                        )
                    finish = "stop"
                    async with contextlib.aclosing(attempt) as chunks:
                        async for item in chunks:
                            if isinstance(item, GenerationChunk):
                                if progress.first_token_at is None:
                                    progress.first_token_at = trio.current_time()
                                yield item
                            else:
                                finish = item
                    self.router.record_outcome(candidate.peer_id, True, trio.current_time())
                    route.append(
                        Attempt(
                            candidate.peer_id,
                            candidate.is_local,
                            Outcome.OK,
                            "",
                            len(progress.generated) - before,
                        )
                    )
                    self.stats["served_local" if candidate.is_local else "served_remote"] += 1
                    if len(route) > 1:
                        self.stats["served_after_fallback"] += 1
                    yield self._result(request_id, tokens, progress, finish, start, route)
                    return
                except _AttemptFailed as exc:
                    produced = len(progress.generated) - before
                    outcome = Outcome.HANDED_OVER if produced else exc.outcome
                    progress.handovers += bool(produced)
                    route.append(
                        Attempt(candidate.peer_id, candidate.is_local, outcome, str(exc), produced)
                    )
                    self.stats[f"attempt_{outcome.value}"] += 1
                    self.router.record_outcome(candidate.peer_id, False, trio.current_time())
                    logger.info(
                        "request %s: %s %s (%s); trying the next candidate",
                        request_id, candidate.peer_id, outcome.value, exc,
                    )
            self.stats["failed"] += 1
            if route and all(a.outcome is Outcome.REFUSED for a in route):
                raise Overloaded(
                    f"every candidate ({len(route)}) is overloaded: "
                    + "; ".join(f"{a.peer_id[:12]}: {a.detail}" for a in route)
                )
            if trio.current_time() >= deadline:
                raise DeadlineExceeded(
                    f"request {request_id} passed its deadline after {len(route)} attempt(s)",
                    route,
                )
            raise RequestFailed(
                f"request {request_id}: no peer could serve it: "
                + "; ".join(f"{a.peer_id[:12]} {a.outcome.value}: {a.detail}" for a in route),
                route,
            )

    async def generate(
        self, token_ids: Sequence[int], params: SamplingParams, **kwargs: Any
    ) -> GenerationResult:
        async with contextlib.aclosing(self.stream(token_ids, params, **kwargs)) as items:
            async for item in items:
                if isinstance(item, GenerationResult):
                    return item
        raise RuntimeError("pipeline ended without a result")  # unreachable by construction

    def statistics(self) -> dict[str, int]:
        out = dict(self.stats)
        out["entry_in_flight"] = self._entry.in_flight
        return out

    # -- routing ------------------------------------------------------------------------

    def _rank(self, tokens: list[int], params: SamplingParams, now: float) -> list[Candidate]:
        load = self._engine.load()
        local = LocalState(
            self._self_id,
            self._engine.local_match_tokens(tokens),
            load.queued_prompt_tokens,
            load.running_requests,
            load.prefill_tokens_per_s,
            load.decode_tokens_per_s,
        )
        chain = self._engine.hasher.chain(tokens)
        candidates: list[Candidate] = self.router.rank(
            chain, len(tokens), params.max_new_tokens, local, self._table, now
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route of %d prompt tokens: %s",
                len(tokens), " | ".join(c.reason for c in candidates[:ROUTE_LOG_CANDIDATES]),
            )
        return candidates

    # -- one attempt each ---------------------------------------------------------------

    async def _run_local(
        self, prompt: list[int], params: SamplingParams, progress: _Progress
    ) -> AsyncGenerator[GenerationChunk | str, None]:
        try:
            slot = self._admission.admit()
        except Overloaded as exc:
            raise _AttemptFailed(Outcome.REFUSED, str(exc)) from exc
        with slot:
            agen = self._engine.stream(prompt, params)
            async with contextlib.aclosing(agen):
                async for item in agen:
                    if isinstance(item, TokenEvent):
                        progress.generated.append(item.token_id)
                        progress.texts.append(item.text)
                        progress.served_by = self._self_id
                        yield GenerationChunk((item.token_id,), item.text, self._self_id)
                    elif isinstance(item, Completion):
                        if progress.cached_tokens is None:
                            progress.cached_tokens = item.usage.cached_tokens
                        yield item.finish_reason

    async def _forward(
        self,
        candidate: Candidate,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        deadline: float,
        progress: _Progress,
    ) -> AsyncGenerator[GenerationChunk | str, None]:
        peer_id = candidate.peer_id
        now = trio.current_time()
        try:
            request = InferRequest(
                request_id=request_id,
                prompt_token_ids=tuple(prompt),
                max_new_tokens=params.max_new_tokens,
                deadline_s=min(deadline - now, MAX_DEADLINE_S),
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                stop=params.stop,
                hops=1,
            )
        except ValueError as exc:  # the engine accepts more than the wire carries
            raise _AttemptFailed(Outcome.FAILED, f"cannot be forwarded: {exc}") from exc
        charge = self._table.record_forward(peer_id, len(prompt), now)
        self.stats["forwards"] += 1
        first_deadline = min(deadline, now + self._config.forward_first_token_s)
        frames: FrameStream | None = None
        got_first = False
        try:
            with trio.fail_at(first_deadline):
                if self._config.forward_delay_s:  # emulated WAN: the request's one-way trip
                    await trio.sleep(self._config.forward_delay_s)
                stream = await self._host.new_stream(
                    ID.from_base58(peer_id), [INFER_PROTOCOL], timeout_s=STREAM_OPEN_TIMEOUT_S
                )
                frames = FrameStream(stream, self._engine.vocab_size)
                await frames.send(request)
            while True:
                gap_deadline = (
                    min(deadline, trio.current_time() + self._config.forward_token_gap_s)
                    if got_first
                    else first_deadline
                )
                with trio.fail_at(gap_deadline):
                    message = await frames.receive_response()
                    if not got_first and self._config.forward_delay_s:
                        await trio.sleep(self._config.forward_delay_s)  # the reply's trip
                if isinstance(message, TokenChunk):
                    if message.token_ids and not got_first:
                        got_first = True
                        if charge is not None:
                            self._table.forward_prefilled(charge)
                    progress.generated.extend(message.token_ids)
                    progress.texts.append(message.text)
                    progress.served_by = peer_id
                    yield GenerationChunk(message.token_ids, message.text, peer_id)
                elif isinstance(message, InferResult):
                    if progress.cached_tokens is None:
                        progress.cached_tokens = message.cached_tokens
                    progress.served_by = message.served_by
                    yield message.finish_reason.value
                    return
                else:
                    raise self._remote_error(message)
        except trio.TooSlowError as exc:
            raise _AttemptFailed(Outcome.STALLED, "no token before the deadline") from exc
        except (StreamBroken, RemoteProtocolError) as exc:
            raise _AttemptFailed(Outcome.FAILED, str(exc)) from exc
        except PeerUnreachable as exc:
            raise _AttemptFailed(Outcome.FAILED, str(exc)) from exc
        finally:
            if charge is not None:
                self._table.forward_ended(charge, prefilled=got_first)
            if frames is not None:
                await frames.reset()  # done or abandoned: the serving peer stops either way

    def _remote_error(self, error: InferError) -> Exception:
        if error.code is ErrorCode.INVALID_REQUEST:
            # Validated here with the same rules: the peer disagrees, so it is faulty.
            return _AttemptFailed(Outcome.FAILED, f"peer rejected a valid request: {error.message}")
        if error.code is ErrorCode.DEADLINE:
            return _AttemptFailed(Outcome.STALLED, f"peer ran out of time: {error.message}")
        return _AttemptFailed(Outcome.REFUSED, f"{error.code.value}: {error.message}")

    def _result(
        self,
        request_id: str,
        tokens: list[int],
        progress: _Progress,
        finish: str,
        start: float,
        route: list[Attempt],
    ) -> GenerationResult:
        end = trio.current_time()
        if progress.handovers:
            # Text re-decoded as a whole, so a character split across peers is not garbled.
            text = self._engine.decode(progress.generated)
        else:
            text = "".join(progress.texts)
        return GenerationResult(
            request_id=request_id,
            token_ids=tuple(progress.generated),
            text=text,
            finish_reason=finish,
            prompt_tokens=len(tokens),
            cached_tokens=progress.cached_tokens or 0,
            completion_tokens=len(progress.generated),
            ttft_s=(progress.first_token_at or end) - start,
            total_s=end - start,
            served_by=progress.served_by,
            route=tuple(route),
        )
