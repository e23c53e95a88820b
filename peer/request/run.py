"""One request's run on the entry peer: race the candidates, deliver, fall back.

A `RequestRun` owns what one request has: its prompt, params, salt, deadline, route and
progress. It races the ranked candidates (peer/request/race.py) with the pipeline's
attempt factory bound to itself, streams the winner's tokens (held back for verification
when the trust ledger chose it), and on a failure hands over to the next candidate with
the prompt plus the tokens so far (greedy output stays identical). Attempts end in a
typed `Outcome`; `RunContext` (peer/request/run_context.py), shared by a pipeline's
runs, records each one where the
swarm learns from it (router back-off, trust, statistics, waiters on the same peer). An
attempt that cost the client time (failed, stalled, lost a hedge race, decoded far slower
than its peer claimed) is charged to that peer's reliability debt in the trust ledger,
and its route entry says how long it was waited on and what it was charged.

Cancel scopes never span a `yield` here: each await has its own deadline, so a slow
consumer (an HTTP client) is never blamed for a slow peer, nor the reverse.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace

import trio

from peer.engine.api import EngineError, GeneratingEngine, SamplingParams
from peer.engine.text import StopTracker
from peer.request.admission import Overloaded
from peer.request.forward import (
    AttemptFailed,
    Delivery,
    Finished,
    RemoteAttempt,
)
from peer.request.generation import (
    Attempt,
    DeadlineExceeded,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    Outcome,
    RequestFailed,
)
from peer.request.race import AnyAttempt, Race, Racer
from peer.request.run_context import RunContext, WrongOutput
from peer.routing.router import Candidate

logger = logging.getLogger(__name__)

# The pipeline's attempt factory: candidate, prompt, params, request id, deadline, salt.
AttemptFactory = Callable[
    [Candidate, list[int], SamplingParams, str, float, bytes | None], AnyAttempt
]


class _Detokenizer:
    """The engine's decode() as StopTracker's tokenizer."""

    def __init__(self, engine: GeneratingEngine) -> None:
        self._engine = engine

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._engine.decode(token_ids))


@dataclass
class Progress:
    """What the request has delivered so far, across attempts."""

    tracker: StopTracker  # the text, decoded here from every token delivered
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    cached_tokens: int | None = None
    served_by: str = ""
    handovers: int = 0  # attempts that streamed tokens and then failed


class RequestRun:
    """One request from its ranked candidates to its GenerationResult."""

    def __init__(
        self,
        context: RunContext,
        request: GenerationRequest,
        make_attempt: AttemptFactory,
        *,
        start: float,
        deadline: float,
    ) -> None:
        self._context = context
        self._make_attempt = make_attempt
        self.request_id = request.request_id
        self.prompt = list(request.token_ids)
        self.params = request.params
        self.cache_salt = request.cache_salt
        self.start = start
        self.deadline = deadline
        self.route: list[Attempt] = []
        self.progress = Progress(StopTracker(_Detokenizer(context.engine), request.params.stop))

    async def stream(
        self, ranked: Sequence[Candidate]
    ) -> AsyncGenerator[GenerationChunk | GenerationResult, None]:
        """Chunks as tokens arrive, then one GenerationResult; Overloaded,
        DeadlineExceeded or RequestFailed when no candidate could serve it."""
        context, progress = self._context, self.progress
        pending = deque(ranked)
        while True:
            remaining = self.params.max_new_tokens - len(progress.generated)
            if remaining <= 0:  # the stream broke after the last token, before the result
                yield self._result(Finished("length"))
                return
            if not pending or self.deadline - trio.current_time() <= 0:
                break
            params = replace(self.params, max_new_tokens=remaining)
            prompt = self.prompt + progress.generated
            racer = await self._race(prompt, params).run(pending)
            if racer is None:
                continue
            candidate, attempt = racer.candidate, racer.attempt
            before = len(progress.generated)
            finish = Finished("stop")
            learn = not before  # the first token of this request: what a forward cost here
            try:
                agen = self._deliver(racer, prompt, params)
                async with contextlib.aclosing(agen) as items:
                    async for item in items:
                        if isinstance(item, GenerationChunk):
                            if learn and item.token_ids:
                                learn = False
                                context.learn_overhead(racer)
                            yield item
                        else:
                            finish = item
            except AttemptFailed as exc:
                produced = len(progress.generated) - before
                outcome = exc.outcome
                if produced and outcome is not Outcome.WRONG_OUTPUT:
                    outcome = Outcome.HANDED_OVER
                progress.handovers += bool(produced)
                context.failed(candidate, outcome, exc, self.route, produced,
                               _silent_s(attempt))
                continue
            finally:
                await attempt.aclose()
            produced = len(progress.generated) - before
            charged = context.served(racer, prompt, produced)
            self.route.append(
                Attempt(candidate.peer_id, candidate.is_local, Outcome.OK,
                        "decoded far slower than it claimed" if charged else "", produced,
                        candidate.reason, charged=charged)
            )
            context.stats["served_local" if candidate.is_local else "served_remote"] += 1
            if len(self.route) > 1:
                context.stats["served_after_fallback"] += 1
            yield self._result(finish)
            return
        raise self._failure()

    def _race(self, prompt: list[int], params: SamplingParams) -> Race:
        """A race of this request's candidates, its attempt factory bound to ``prompt``."""
        context = self._context

        def make_attempt(candidate: Candidate) -> AnyAttempt:
            return self._make_attempt(
                candidate, prompt, params, self.request_id, self.deadline, self.cache_salt
            )

        def on_failed(candidate: Candidate, exc: AttemptFailed, waited_s: float) -> None:
            context.failed(candidate, exc.outcome, exc, self.route, 0, waited_s)

        return Race(
            config=context.config, trust=context.trust, rng=context.rng, stats=context.stats,
            waiters=context.waiters, make_attempt=make_attempt, on_failed=on_failed,
            deadline=self.deadline,
        )

    def _failure(self) -> Overloaded | RequestFailed:
        """The one error at the end, with every attempt's cause."""
        route = self.route
        self._context.stats["failed"] += 1
        if route and all(a.outcome is Outcome.REFUSED for a in route):
            return Overloaded(
                f"every candidate ({len(route)}) is overloaded: "
                + "; ".join(f"{a.peer_id[:12]}: {a.detail}" for a in route)
            )
        if trio.current_time() >= self.deadline:
            return DeadlineExceeded(
                f"request {self.request_id} passed its deadline after {len(route)} attempt(s)",
                route,
            )
        return RequestFailed(
            f"request {self.request_id}: no peer could serve it: "
            + "; ".join(f"{a.peer_id[:12]} {a.outcome.value}: {a.detail}" for a in route),
            route,
        )

    # -- delivery ---------------------------------------------------------------------------

    async def _deliver(
        self, racer: Racer, prompt: list[int], params: SamplingParams
    ) -> AsyncGenerator[GenerationChunk | Finished, None]:
        """The winner's tokens to the client (after verification if chosen), then how it
        finished. The attempt is closed as soon as its last token is read, verified or not
        (closing again later does nothing)."""
        attempt, progress = racer.attempt, self.progress
        served_by = self._context.self_id if attempt.is_local else racer.candidate.peer_id
        if not racer.verify:
            if not attempt.is_local:
                self._context.stats["responses_unverified"] += 1
            tokens: Delivery = attempt.first
            while not isinstance(tokens, Finished):
                yield self._emit(tokens, served_by)
                tokens = await attempt.next_tokens()
            finish = tokens
            await attempt.aclose()  # at once, as below: closing tells nothing of a check
            self._context.audit(attempt)
        else:
            output = list(attempt.first)
            while not isinstance(more := await attempt.next_tokens(), Finished):
                output.extend(more)
            finish = more
            # The stream ends now, before the verdict: a serving peer that timed its
            # stream's end would otherwise learn which of its answers are checked.
            await attempt.aclose()
            good = await self._verified_prefix(prompt, output, params, served_by)
            if good is not None:
                self._context.accuse(attempt)
                if good:
                    yield self._emit(good, served_by)
                raise WrongOutput(f"verification failed after {len(good)} good tokens")
            yield self._emit(output, served_by)
        if progress.cached_tokens is None:
            progress.cached_tokens = attempt.cached_tokens
        before = progress.tracker.text
        progress.tracker.push(progress.generated, final=True)
        rest = progress.tracker.text[len(before):]
        if rest:  # text held back while it might have been the start of a stop string
            yield GenerationChunk((), rest, served_by)
        yield finish

    async def _verified_prefix(
        self, prompt: list[int], output: list[int], params: SamplingParams, peer_id: str
    ) -> list[int] | None:
        """None if ``output`` verifies; else its good prefix (the peer is quarantined)."""
        context = self._context
        if context.verify is None:  # should_verify is False without one
            raise AttemptFailed(Outcome.FAILED, "no verifier")
        try:
            verdict = await context.verify(prompt, output, params)
        except (EngineError, ValueError, RuntimeError) as exc:
            context.stats["verification_errors"] += 1
            raise AttemptFailed(Outcome.FAILED, f"could not verify: {exc}") from exc
        context.stats["responses_verified"] += 1
        if verdict.ok:
            return None
        context.stats["verification_failed"] += 1
        context.quarantine(peer_id, f"wrong output: {verdict.detail}")
        bad = verdict.first_bad_index
        return output[:bad] if bad is not None and 0 <= bad <= len(output) else []

    def _emit(self, tokens: list[int], served_by: str) -> GenerationChunk:
        progress = self.progress
        progress.generated.extend(tokens)
        delta, _ = progress.tracker.push(progress.generated, final=False)
        progress.served_by = served_by
        if progress.first_token_at is None:
            progress.first_token_at = trio.current_time()
        return GenerationChunk(tuple(tokens), delta, served_by)

    def _result(self, finish: Finished) -> GenerationResult:
        progress = self.progress
        end = trio.current_time()
        progress.tracker.push(progress.generated, final=True)
        text = progress.tracker.text  # decoded here as a whole, cut at a stop string
        return GenerationResult(
            request_id=self.request_id,
            token_ids=tuple(progress.generated),
            text=text,
            finish_reason=finish.reason,
            prompt_tokens=len(self.prompt),
            cached_tokens=progress.cached_tokens or 0,
            completion_tokens=len(progress.generated),
            ttft_s=(progress.first_token_at or end) - self.start,
            total_s=end - self.start,
            served_by=progress.served_by,
            route=tuple(self.route),
        )


def _silent_s(attempt: AnyAttempt) -> float:
    """How long a stream that failed during delivery had been silent: since its last
    token (a remote one), else 0."""
    last = attempt.last_at if isinstance(attempt, RemoteAttempt) else None
    return max(0.0, trio.current_time() - last) if last is not None else 0.0
