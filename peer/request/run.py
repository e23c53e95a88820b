"""One request's run on the entry peer: race the candidates, deliver, fall back.

A `RequestRun` owns what one request has: its prompt, params, salt, deadline, route and
progress. It races the ranked candidates (peer/request/race.py) with the pipeline's
attempt factory bound to itself, streams the winner's tokens (held back for verification
when the trust ledger chose it), and on a failure hands over to the next candidate with
the prompt plus the tokens so far (greedy output stays identical). Attempts end in a
typed `Outcome`; `RunContext`, shared by a pipeline's runs, records each one where the
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
import random
from collections import Counter, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import trio

from peer.config import PeerConfig
from peer.engine.api import EngineError, GeneratingEngine, SamplingParams
from peer.engine.speeds import forward_speeds
from peer.engine.text import StopTracker
from peer.request.admission import Overloaded
from peer.request.forward import (
    AttemptFailed,
    Delivery,
    Faulty,
    Finished,
    HedgeLost,
    MovedOn,
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
from peer.request.race import AnyAttempt, Race, Racer, Waiters
from peer.routing.claims import claimed_decode, priced_stream_decode
from peer.routing.cost import PeerEstimate
from peer.routing.reliability import Lapse
from peer.routing.router import Candidate, Router
from peer.routing.trust import Promote, Quarantine, TrustLedger
from peer.swarm.peer_table import PeerTable
from protocols.answers import Evidence

logger = logging.getLogger(__name__)

# The pipeline's attempt factory: candidate, prompt, params, request id, deadline, salt.
AttemptFactory = Callable[
    [Candidate, list[int], SamplingParams, str, float, bytes | None], AnyAttempt
]


class _WrongOutput(AttemptFailed):
    def __init__(self, detail: str) -> None:
        super().__init__(Outcome.WRONG_OUTPUT, detail)


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


class RunContext:
    """What every run of one pipeline shares, and where each attempt's outcome is
    recorded: the router backs off a failed peer, the trust ledger learns, requests
    waiting on the same peer's first token move on."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        engine: GeneratingEngine,
        router: Router,
        table: PeerTable,
        trust: TrustLedger,
        rng: random.Random,
        stats: Counter[str],
        self_id: str,
        on_quarantine: Callable[[Quarantine], None] | None = None,
        on_evidence: Callable[[Evidence], None] | None = None,
        on_audit: Callable[[Evidence], bool] | None = None,
        served_elsewhere: Callable[[str, Sequence[int]], Awaitable[str | None]] | None = None,
    ) -> None:
        self.config = config
        # who, if anyone, says a peer asked it for a prompt (peer/request/served_service.py)
        self.served_elsewhere = served_elsewhere
        self.engine = engine
        self.router = router
        self.table = table
        self.trust = trust
        self.rng = rng
        self.stats = stats
        self.self_id = self_id
        self.verify = engine.verify
        self.waiters = Waiters()
        self._on_quarantine = on_quarantine
        self._on_evidence = on_evidence
        self._on_audit = on_audit

    def accuse(self, attempt: object) -> None:
        """Tell other peers of a verified lie: the attempt's signed answer (none: a local
        attempt, or an answer without its signed result)."""
        if isinstance(attempt, RemoteAttempt) and self._on_evidence is not None:
            evidence = attempt.evidence()
            if evidence is not None:
                self.stats["evidence_found"] += 1
                self._on_evidence(evidence)

    def audit(self, attempt: object) -> None:
        """Hand a remote answer delivered unverified to an audit, if the ledger wants one
        (peer/routing/trust.py `should_audit`): it is re-scored off the client's path and
        a wrong one quarantines its server here and is told to others as evidence."""
        if not isinstance(attempt, RemoteAttempt) or self._on_audit is None:
            return
        if not self.trust.should_audit(attempt.peer_id):
            return
        evidence = attempt.evidence()
        if evidence is None:
            return
        if self._on_audit(evidence):
            self.trust.record_audit(attempt.peer_id)
            self.stats["responses_audited"] += 1
        else:
            self.stats["audits_dropped"] += 1

    def learn_overhead(self, racer: Racer) -> None:
        """At a request's first token delivered: a request served here ages ForwardOverhead;
        a direct forward's delivery time is kept for `served`, which teaches it once the
        serving peer's result has said its engine's time (not a dial's or relay's setup)."""
        attempt = racer.attempt
        if isinstance(attempt, RemoteAttempt):
            attempt.delivered_at = trio.current_time()
        else:
            self.router.forward_overhead.served_here()

    def _learn_forward(self, racer: Racer) -> None:
        """ForwardOverhead learns a direct forward's wait here before its request went out,
        for its first token beyond the round trip and the serving engine's own time, and
        after that token came until it was delivered (forward_overhead.py)."""
        attempt = racer.attempt
        if not isinstance(attempt, RemoteAttempt) or not attempt.direct:
            return
        sent, first, delivered = attempt.sent_at, attempt.first_at, attempt.delivered_at
        if sent is None or first is None or delivered is None:
            return
        self.router.forward_overhead.forwarded(
            max(0.0, sent - racer.started_at), racer.candidate.estimate.rtt_s,
            max(0.0, delivered - first), peer_id=attempt.peer_id,
            first_wait_s=max(0.0, first - sent),
            server_ttft_s=attempt.server_ttft_s,
        )

    def served(self, racer: Racer, prompt: list[int], produced: int) -> float:
        """The winner delivered ``produced`` tokens and finished; what it was charged for
        underdelivering (0 mostly)."""
        peer_id = racer.candidate.peer_id
        now = trio.current_time()
        self.router.record_outcome(peer_id, True, now)
        attempt = racer.attempt
        if not isinstance(attempt, RemoteAttempt):
            return 0.0
        self._learn_forward(racer)
        action = self.trust.record_served(peer_id, verified=racer.verify, now=now)
        if isinstance(action, Promote):
            logger.info("peer %s passed probation (%d verified)", peer_id, action.verified)
        return self.observe(peer_id, attempt, prompt, produced, racer.candidate.estimate)

    def observe(
        self, peer_id: str, attempt: RemoteAttempt, prompt: list[int], produced: int,
        estimate: PeerEstimate,
    ) -> float:
        """What a finished forward showed of ``peer_id``: its claim, its speeds, and the
        charge (0 mostly) if it decoded far slower than ``estimate`` priced it at."""
        cached = attempt.cached_tokens
        block = self.engine.block_size
        if cached is not None:
            chain = self.engine.hasher.chain(prompt)
            claimed = self.table.estimate_match(peer_id, chain) * block
            self.trust.record_claim(peer_id, min(claimed, (len(prompt) - 1) // block * block),
                                    cached)
        sent, first, last = attempt.sent_at, attempt.first_at, attempt.last_at
        ttft = span = None
        if sent is not None and first is not None and cached is not None:
            ttft = first - sent
        if first is not None and last is not None:
            span = last - first
        computed = len(prompt) - (cached or 0)
        prefill, decode = forward_speeds(
            computed, ttft, produced, span, queued_tokens=estimate.queued_prompt_tokens,
            rtt_s=estimate.rtt_s, own_prefill_tokens_per_s=self.engine.load().prefill_tokens_per_s)
        self.trust.record_speeds(peer_id, prefill, decode)
        view = self.table.get(peer_id, trio.current_time())
        if view is None or decode is None:
            return 0.0
        claimed_speed = priced_stream_decode(
            claimed_decode(view.summary.decode_tokens_per_s,
                           view.summary.batch_decode_tokens_per_s),
            estimate.running_requests, estimate.batch_slots, self.router.policy)
        charged = self.trust.record_delivery(peer_id, claimed_speed, decode, trio.current_time())
        if charged:
            self.stats["charged_underdelivered"] += 1
        return charged

    def failed(
        self, candidate: Candidate, outcome: Outcome, exc: AttemptFailed, route: list[Attempt],
        produced: int, waited_s: float = 0.0,
    ) -> None:
        """Record a failed attempt at once (in the request's ``route`` too), ``waited_s``
        the time the client waited on it in vain."""
        peer_id = candidate.peer_id
        now = trio.current_time()
        charged = 0.0
        lapse = None if candidate.is_local else _lapse_of(exc)
        if lapse is not None:
            charged = self.trust.record_lapse(peer_id, lapse, now)
            if charged:
                self.stats[f"charged_{lapse.value}"] += 1
        route.append(
            Attempt(peer_id, candidate.is_local, outcome, str(exc), produced, candidate.reason,
                    waited_s, charged)
        )
        self.stats[f"attempt_{outcome.value}"] += 1
        blamed = not isinstance(exc, (MovedOn, HedgeLost))  # MovedOn: recorded already
        if blamed:
            self.router.record_outcome(peer_id, False, now)
        if isinstance(exc, Faulty):
            self.quarantine(peer_id, str(exc))
        if blamed and outcome is not Outcome.REFUSED and not candidate.is_local:
            self.waiters.cancel(peer_id)
        logger.info("%s: %s (%s); trying the next candidate", peer_id, outcome.value, exc)

    def quarantine(self, peer_id: str, reason: str) -> None:
        action = self.trust.quarantine(peer_id, reason, trio.current_time())
        if action is not None:
            self.quarantined(action)

    def quarantined(self, action: Quarantine) -> None:
        """Carry out the ledger's quarantine: log, persist, move waiters on."""
        peer_id, reason = action.peer_id, action.reason
        self.stats["quarantined"] += 1
        logger.warning("peer %s quarantined: %s", peer_id, reason)
        self.waiters.cancel(peer_id)
        if self._on_quarantine is not None:
            self._on_quarantine(action)


def _lapse_of(exc: AttemptFailed) -> Lapse | None:
    """What a remote attempt's failure charges its peer: nothing when the failure is not
    its own doing now (a refusal when overloaded is honest, MovedOn was charged for the
    request it failed, a wrong answer or a faulty one quarantines it)."""
    if isinstance(exc, HedgeLost):
        return Lapse.HEDGE_LOST
    if isinstance(exc, (MovedOn, Faulty, _WrongOutput)):
        return None
    if exc.outcome is Outcome.STALLED:
        return Lapse.STALLED
    if exc.outcome is Outcome.FAILED:
        return Lapse.FAILED
    return None


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
                raise _WrongOutput(f"verification failed after {len(good)} good tokens")
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
