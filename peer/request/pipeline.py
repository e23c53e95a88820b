"""The entry peer's request path: admit, route, forward or run locally, fall back.

Happy eyeballs (STYLE.md item 5): the router ranks candidates and they race for the first
token. Before the race, the candidates worth a round trip are asked for their load now
(peer/routing/probing.py decides whom and how long; peer/routing/probe_service.py asks) and the same
candidates are ranked again; one that does not answer in time keeps its gossiped load.
A remote candidate with no first token after its hedge delay (a multiple of the
router's own TTFT estimate for it, with a floor) gets company: the next candidate starts
too, and the first to deliver a token wins; the others are cancelled (one that was
hedged and lost shows as stalled, but is not backed off). Each remote candidate's
first-token deadline is a multiple of that estimate, with a floor, capped by
``forward_first_token_s``. A failure or stall is recorded at once: concurrent requests
stop choosing that peer, and those waiting on its first token move on. A candidate that
fails after streaming tokens hands over to the next with the prompt plus the tokens so
far (greedy output stays identical).
The entry peer itself is always among the candidates, so the request completes if this
peer can run it. One `RequestFailed` at the end carries every attempt's cause.

Remote output is data (peer/request/forward.py): at most ``max_new_tokens``, ids in the
vocabulary, text decoded here, ``served_by`` the id of the peer dialed. A response chosen
for verification (the trust ledger decides: always on probation, else with probability
``verify_fraction``) is held back until the engine's teacher-forced ``verify`` accepts it;
a wrong one quarantines the peer, and its verified-good prefix (if any) is kept.

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
from peer.engine.text import StopTracker
from peer.net.streams import StreamOpener
from peer.request.admission import Admission, Overloaded
from peer.request.forward import (
    AttemptFailed,
    Faulty,
    HedgeLost,
    LocalAttempt,
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
from peer.request.race import AnyAttempt, Race, Racer
from peer.routing.probe_service import probe_loads
from peer.routing.probing import DEFAULT_MIN_WAIT_S, ProbeRound, ProbeSettings, plan_probes
from peer.routing.router import Candidate, LocalState, Router
from peer.routing.trust import Promote, Quarantine, TrustLedger
from peer.swarm.peer_table import PeerTable

__all__ = [  # the request's types live in peer/request/generation.py; importable here as before
    "Attempt",
    "DeadlineExceeded",
    "GenerationChunk",
    "GenerationResult",
    "Outcome",
    "Pipeline",
    "RequestFailed",
]

logger = logging.getLogger(__name__)
ROUTE_LOG_CANDIDATES = 3  # the candidates a DEBUG log line explains, best first
# A forward's speeds are observed (they cap what the peer advertises) only when compute
# dominates the round trips and overheads in its timing: a cache hit that computes 3
# tokens in 10 ms says nothing of the peer's prefill speed.
MIN_OBSERVED_PREFILL_TOKENS = 64
MIN_OBSERVED_DECODE_TOKENS = 8



class _WrongOutput(AttemptFailed):
    def __init__(self, detail: str) -> None:
        super().__init__(Outcome.WRONG_OUTPUT.value, detail)


class _Detokenizer:
    """The engine's decode() as StopTracker's tokenizer."""

    def __init__(self, engine: GeneratingEngine) -> None:
        self._engine = engine

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._engine.decode(token_ids))


@dataclass
class _Progress:
    """What the request has delivered so far, across attempts."""

    tracker: StopTracker  # the text, decoded here from every token delivered
    generated: list[int] = field(default_factory=list)
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
        engine: GeneratingEngine,
        router: Router,
        table: PeerTable,
        host: StreamOpener,
        admission: Admission,
        self_id: str,
        trust: TrustLedger | None = None,
        rng: random.Random | None = None,
        on_quarantine: Callable[[Quarantine], None] | None = None,
        before_route: Callable[[Sequence[int], Sequence[int], float], Awaitable[None]]
        | None = None,
    ) -> None:
        """`before_route(tokens, chain, deadline)`, if given, is awaited before each
        request is ranked (gossip mode ring's lookup, peer/swarm/lookup.py: it may add peers to
        the table)."""
        self._config = config
        self._before_route = before_route
        self._engine = engine
        self.router = router
        self._table = table
        self._host = host
        self._admission = admission
        self._entry = Admission(config.max_queue * 4, name="entry queue")
        self._self_id = self_id
        self._verify = engine.verify
        if trust is None:
            trust = router.trust or TrustLedger(
                verify_fraction=config.verify_fraction,
                probation_requests=config.probation_requests,
                probation_share=config.probation_share,
                can_verify=self._verify is not None,
            )
        self.trust = trust
        self._rng = rng or random.Random()
        self._on_quarantine = on_quarantine
        self._probe_settings = ProbeSettings(
            max_probes=config.load_probes,
            max_wait_s=config.load_probe_wait_s,
            min_wait_s=min(DEFAULT_MIN_WAIT_S, config.load_probe_wait_s),
        )
        self.stats: Counter[str] = Counter()
        self.race = Race(
            config=config,
            trust=trust,
            rng=self._rng,
            stats=self.stats,
            make_attempt=self._attempt,
            on_failed=lambda c, exc, route: self._attempt_failed(
                c, Outcome(exc.outcome), exc, route, 0
            ),
        )

    # -- the public path ----------------------------------------------------------------

    async def stream(
        self, request: GenerationRequest
    ) -> AsyncGenerator[GenerationChunk | GenerationResult, None]:
        """Chunks as tokens arrive, then one GenerationResult, for a request validated
        already (peer/request/serving.py's `prepare`).

        A request with a `cache_salt` is private: served here only (never forwarded, so
        its prompt and salt stay on this peer), over this peer's blocks of the same salt.

        Raises Overloaded (this peer holds too many requests), DeadlineExceeded or
        RequestFailed.
        """
        tokens = list(request.token_ids)
        params, request_id, cache_salt = request.params, request.request_id, request.cache_salt
        timeout_s = request.timeout_s
        try:
            slot = self._entry.admit()
        except Overloaded:
            self.stats["overloaded"] += 1
            raise
        with slot:
            self.stats["requests"] += 1
            start = trio.current_time()
            deadline = start + (timeout_s or self._config.request_timeout_s)
            progress = _Progress(StopTracker(_Detokenizer(self._engine), params.stop))
            route: list[Attempt] = []
            chain = self._engine.hasher.chain(tokens)
            if self._before_route is not None and cache_salt is None:
                await self._before_route(tokens, chain, deadline)
            ranked = self._rank(tokens, params, trio.current_time(), chain)
            if cache_salt is not None:
                ranked = [c for c in ranked if c.is_local]
            else:
                ranked = await self._probe(ranked, deadline)
            pending = deque(ranked)
            while True:
                remaining = params.max_new_tokens - len(progress.generated)
                if remaining <= 0:  # the stream broke after the last token, before the result
                    yield self._result(request_id, tokens, progress, "length", start, route)
                    return
                if not pending or deadline - trio.current_time() <= 0:
                    break
                sub_params = replace(params, max_new_tokens=remaining)
                prompt = tokens + progress.generated
                racer = await self.race.run(
                    pending, prompt, sub_params, request_id, deadline, route,
                    cache_salt=cache_salt,
                )
                if racer is None:
                    continue
                candidate, attempt = racer.candidate, racer.attempt
                before = len(progress.generated)
                finish = "stop"
                try:
                    agen = self._deliver(racer, prompt, sub_params, progress)
                    async with contextlib.aclosing(agen) as items:
                        async for item in items:
                            if isinstance(item, GenerationChunk):
                                yield item
                            else:
                                finish = item
                except AttemptFailed as exc:
                    produced = len(progress.generated) - before
                    outcome = Outcome(exc.outcome)
                    if produced and outcome is not Outcome.WRONG_OUTPUT:
                        outcome = Outcome.HANDED_OVER
                    progress.handovers += bool(produced)
                    self._attempt_failed(candidate, outcome, exc, route, produced)
                    continue
                finally:
                    await attempt.aclose()
                self._attempt_ok(racer, prompt, before, progress)
                route.append(
                    Attempt(candidate.peer_id, candidate.is_local, Outcome.OK, "",
                            len(progress.generated) - before, candidate.reason)
                )
                self.stats["served_local" if candidate.is_local else "served_remote"] += 1
                if len(route) > 1:
                    self.stats["served_after_fallback"] += 1
                yield self._result(request_id, tokens, progress, finish, start, route)
                return
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

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        async with contextlib.aclosing(self.stream(request)) as items:
            async for item in items:
                if isinstance(item, GenerationResult):
                    return item
        raise RuntimeError("pipeline ended without a result")  # unreachable by construction

    def statistics(self) -> dict[str, int]:
        out = dict(self.stats)
        out["entry_in_flight"] = self._entry.in_flight
        out["verification_available"] = int(self._verify is not None)
        return out

    # -- routing ------------------------------------------------------------------------

    def _rank(
        self, tokens: list[int], params: SamplingParams, now: float,
        chain: list[int] | None = None,
    ) -> list[Candidate]:
        load = self._engine.load()
        local = LocalState(
            self._self_id,
            self._engine.local_match_tokens(tokens),
            load.queued_prompt_tokens,
            load.running_requests,
            load.prefill_tokens_per_s,
            load.decode_tokens_per_s,
            load.batch_decode_tokens_per_s,
            load.batch_slots,
            load.step_tokens,
        )
        if chain is None:
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

    async def _probe(self, ranked: list[Candidate], deadline: float) -> list[Candidate]:
        """``ranked`` again with the fresh load of the candidates worth a probe
        (peer/routing/probing.py decides whom and how long; unanswered ones keep their gossip)."""
        plan = plan_probes(ranked, self._probe_settings)
        if not plan.probes:
            return ranked
        probe = ProbeRound(plan, trio.current_time(), not_after=deadline)
        reports = await probe_loads(self._host, probe, self.stats)
        if not reports:
            return ranked
        again = self.router.rerank(ranked, reports, self._table, trio.current_time())
        if again[0].peer_id != ranked[0].peer_id:
            self.stats["probe_changed_choice"] += 1
        return again

    def _attempt(
        self,
        candidate: Candidate,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        deadline: float,
        cache_salt: bytes | None = None,
    ) -> AnyAttempt:
        if candidate.is_local:
            return LocalAttempt(self._engine, self._admission, prompt, params, cache_salt)
        attempt = RemoteAttempt(  # AttemptFailed if the wire cannot carry it
            host=self._host,
            table=self._table,
            peer_id=candidate.peer_id,
            request_id=request_id,
            prompt=prompt,
            params=params,
            vocab_size=self._engine.vocab_size,
            gap_s=self._config.forward_token_gap_s,
            deadline=deadline,
            delay_s=self._config.forward_delay_s,
        )
        self.stats["forwards"] += 1
        return attempt

    # -- delivery ---------------------------------------------------------------------------

    async def _deliver(
        self, racer: Racer, prompt: list[int], params: SamplingParams, progress: _Progress
    ) -> AsyncGenerator[GenerationChunk | str, None]:
        """The winner's tokens to the client (after verification if chosen), then the
        finish reason."""
        attempt = racer.attempt
        served_by = self._self_id if attempt.is_local else racer.candidate.peer_id
        if not racer.verify:
            if not attempt.is_local:
                self.stats["responses_unverified"] += 1
            tokens: list[int] | str = attempt.first
            while not isinstance(tokens, str):
                yield self._emit(tokens, progress, served_by)
                tokens = await attempt.next_tokens()
            finish = tokens
        else:
            output = list(attempt.first)
            while not isinstance(more := await attempt.next_tokens(), str):
                output.extend(more)
            finish = more
            good = await self._verified_prefix(prompt, output, params, served_by)
            if good is not None:
                if good:
                    yield self._emit(good, progress, served_by)
                raise _WrongOutput(f"verification failed after {len(good)} good tokens")
            yield self._emit(output, progress, served_by)
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
        if self._verify is None:
            raise AttemptFailed("failed", "no verifier")  # should_verify is False without one
        try:
            verdict = await self._verify(prompt, output, params)
        except (EngineError, ValueError, RuntimeError) as exc:
            self.stats["verification_errors"] += 1
            raise AttemptFailed("failed", f"could not verify: {exc}") from exc
        self.stats["responses_verified"] += 1
        if verdict.ok:
            return None
        self.stats["verification_failed"] += 1
        self._quarantine(peer_id, f"wrong output: {verdict.detail}")
        bad = verdict.first_bad_index
        return output[:bad] if bad is not None and 0 <= bad <= len(output) else []

    def _emit(self, tokens: list[int], progress: _Progress, served_by: str) -> GenerationChunk:
        progress.generated.extend(tokens)
        delta, _ = progress.tracker.push(progress.generated, final=False)
        progress.served_by = served_by
        if progress.first_token_at is None:
            progress.first_token_at = trio.current_time()
        return GenerationChunk(tuple(tokens), delta, served_by)

    # -- outcomes -------------------------------------------------------------------------------

    def _attempt_ok(
        self, racer: Racer, prompt: list[int], before: int, progress: _Progress
    ) -> None:
        peer_id = racer.candidate.peer_id
        self.router.record_outcome(peer_id, True, trio.current_time())
        attempt = racer.attempt
        if not isinstance(attempt, RemoteAttempt):
            return
        action = self.trust.record_served(peer_id, verified=racer.verify)
        if isinstance(action, Promote):
            logger.info("peer %s passed probation (%d verified)", peer_id, action.verified)
        cached = attempt.cached_tokens
        block = self._engine.block_size
        if cached is not None:
            chain = self._engine.hasher.chain(prompt)
            claimed = self._table.estimate_match(peer_id, chain) * block
            self.trust.record_claim(peer_id, min(claimed, (len(prompt) - 1) // block * block),
                                    cached)
        prefill = decode = None
        if attempt.sent_at is not None and attempt.first_at is not None and cached is not None:
            ttft = attempt.first_at - attempt.sent_at
            if ttft > 0 and len(prompt) - cached >= MIN_OBSERVED_PREFILL_TOKENS:
                prefill = (len(prompt) - cached) / ttft
        produced = len(progress.generated) - before
        if (attempt.first_at is not None and attempt.last_at is not None
                and produced >= MIN_OBSERVED_DECODE_TOKENS):
            span = attempt.last_at - attempt.first_at
            decode = (produced - 1) / span if span > 0 else None
        self.trust.record_speeds(peer_id, prefill, decode)

    def _attempt_failed(
        self,
        candidate: Candidate,
        outcome: Outcome,
        exc: AttemptFailed,
        route: list[Attempt],
        produced: int,
    ) -> None:
        """Record a failed attempt at once: the router backs off, and requests waiting on
        the same peer's first token move on."""
        peer_id = candidate.peer_id
        route.append(
            Attempt(peer_id, candidate.is_local, outcome, str(exc), produced, candidate.reason)
        )
        self.stats[f"attempt_{outcome.value}"] += 1
        blamed = not isinstance(exc, (MovedOn, HedgeLost))  # MovedOn: recorded already
        if blamed:
            self.router.record_outcome(peer_id, False, trio.current_time())
        if isinstance(exc, Faulty):
            self._quarantine(peer_id, str(exc))
        if blamed and outcome is not Outcome.REFUSED and not candidate.is_local:
            self.race.cancel_waiters(peer_id)
        logger.info(
            "%s: %s (%s); trying the next candidate", peer_id, outcome.value, exc
        )

    def _quarantine(self, peer_id: str, reason: str) -> None:
        action = self.trust.quarantine(peer_id, reason, trio.current_time())
        if action is None:
            return
        self.stats["quarantined"] += 1
        logger.warning("peer %s quarantined: %s", peer_id, reason)
        self.race.cancel_waiters(peer_id)
        if self._on_quarantine is not None:
            self._on_quarantine(action)

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
        progress.tracker.push(progress.generated, final=True)
        text = progress.tracker.text  # decoded here as a whole, cut at a stop string
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
