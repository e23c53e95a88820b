"""The entry peer's request path: admit, route, then run the request over the swarm.

Happy eyeballs (STYLE.md item 5): the router ranks candidates and they race for the first
token. Before the race, the candidates worth a round trip are asked for their load now
(peer/routing/decide.py and probing.py decide whom and how long;
peer/routing/probe_service.py asks) and the same candidates are ranked again; one that
does not answer in time keeps its gossiped load. Then a `RequestRun` (peer/request/run.py)
races them (peer/request/race.py: hedging, stalls), streams the winner and falls back;
the entry peer itself is always among the candidates, so the request completes if this
peer can run it. One `RequestFailed` at the end carries every attempt's cause.

Remote output is data (peer/request/forward.py): at most ``max_new_tokens``, ids in the
vocabulary, text decoded here, ``served_by`` the id of the peer dialed. A response chosen
for verification (the trust ledger decides: with probability ``verify_fraction``) is held
back until the engine's teacher-forced ``verify`` accepts it; a wrong one quarantines the
peer, and its verified-good prefix (if any) is kept. Peers on probation serve no client:
a request may carry a shadow copy to one of them (peer/request/shadow.py), compared with
the answer the client received.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

import trio

from peer.config import PeerConfig
from peer.engine.api import SEED_BITS, GeneratingEngine, SamplingParams
from peer.net.wire import StreamOpener
from peer.request.admission import Admission, Overloaded
from peer.request.forward import LocalAttempt, RemoteAttempt
from peer.request.generation import (
    Attempt,
    DeadlineExceeded,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    Outcome,
    RequestFailed,
)
from peer.request.race import AnyAttempt, token_gap_s
from peer.request.run import RequestRun
from peer.request.run_context import RunContext
from peer.request.shadow import Shadows
from peer.routing.decide import ProbeFirst, next_step
from peer.routing.probe_service import probe_loads
from peer.routing.probing import DEFAULT_MIN_WAIT_S, ProbeSettings
from peer.routing.router import Candidate, LocalState, Ranked, Router
from peer.routing.shadow import DEFAULT_MAX_SHADOWS_IN_FLIGHT, ShadowPlanner
from peer.routing.trust import Quarantine, TrustLedger
from peer.swarm.peer_table import PeerTable
from protocols.answers import Evidence

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
        trust: TrustLedger,
        rng: random.Random | None = None,
        on_quarantine: Callable[[Quarantine], None] | None = None,
        on_evidence: Callable[[Evidence], None] | None = None,
        on_audit: Callable[[Evidence], bool] | None = None,
        before_route: Callable[[Sequence[int], Sequence[int], float], Awaitable[None]]
        | None = None,
        served_elsewhere: Callable[[str, Sequence[int]], Awaitable[str | None]] | None = None,
    ) -> None:
        """``trust``: the peer's one ledger (peer/request/serving.py builds it, and the
        router reads it). `before_route(tokens, chain, deadline)`, if given, is awaited
        before each request is ranked (gossip mode ring's lookup, peer/swarm/lookup.py: it
        may add peers to the table). `served_elsewhere(peer_id, prompt)`, if given, names a peer
        that says `peer_id` asked it for `prompt` (a probation answer obtained elsewhere)."""
        self._config = config
        self._before_route = before_route
        self._engine = engine
        self._table = table
        self._host = host
        self._admission = admission
        self._entry = Admission(config.max_queue * 4, name="entry queue")
        self._probe_settings = ProbeSettings(
            max_probes=config.load_probes,
            max_wait_s=config.load_probe_wait_s,
            min_wait_s=min(DEFAULT_MIN_WAIT_S, config.load_probe_wait_s),
        )
        self.stats: Counter[str] = Counter()
        rng = rng or random.Random()
        self._context = RunContext(
            config=config, engine=engine, router=router, table=table, trust=trust,
            rng=rng, stats=self.stats, self_id=self_id,
            on_quarantine=on_quarantine, on_evidence=on_evidence, on_audit=on_audit,
            served_elsewhere=served_elsewhere,
        )
        self.shadows = Shadows(
            planner=ShadowPlanner(trust, share=config.probation_share,
                                  max_in_flight=DEFAULT_MAX_SHADOWS_IN_FLIGHT),
            context=self._context, make_attempt=self._remote_attempt, rng=rng,
        )

    @property
    def config(self) -> PeerConfig:
        return self._config

    def quarantine(self, peer_id: str, reason: str) -> None:
        """Quarantine ``peer_id`` as a verified lie here would (log, persist, waiters)."""
        self._context.quarantine(peer_id, reason)

    @property
    def router(self) -> Router:
        return self._context.router

    @router.setter
    def router(self, router: Router) -> None:
        self._context.router = router

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
        try:
            slot = self._entry.admit()
        except Overloaded:
            self.stats["overloaded"] += 1
            raise
        with slot:
            self.stats["requests"] += 1
            request = self._seeded(request)
            start = trio.current_time()
            deadline = start + (request.timeout_s or self._config.request_timeout_s)
            run = RequestRun(self._context, request, self._attempt, start=start,
                             deadline=deadline)
            ranked, probation = await self._route(request, deadline)
            shadow = self.shadows.start(
                probation, list(request.token_ids), request.params,
                private=request.cache_salt is not None, deadline=deadline,
            )
            try:
                async with contextlib.aclosing(run.stream(ranked)) as items:
                    async for item in items:
                        if shadow is not None and isinstance(item, GenerationResult):
                            shadow.deliver(item.token_ids)
                        yield item
            finally:
                if shadow is not None:
                    shadow.abandon()  # nothing if delivered already

    def _seeded(self, request: GenerationRequest) -> GenerationRequest:
        """The request with the seed its sampled tokens are drawn with: the client's, or
        one chosen here. Every candidate, the shadow and the verifier use this one seed,
        so each sampled token is the one the seed selects (peer/engine/sampling.py)."""
        params = request.params
        if params.temperature == 0.0 or params.seed is not None:
            return request
        seed = self._context.rng.getrandbits(SEED_BITS)
        return dataclasses.replace(request, params=dataclasses.replace(params, seed=seed))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        async with contextlib.aclosing(self.stream(request)) as items:
            async for item in items:
                if isinstance(item, GenerationResult):
                    return item
        raise RuntimeError("pipeline ended without a result")  # unreachable by construction

    @property
    def entry_in_flight(self) -> int:
        """Requests that entered here and have not ended."""
        return self._entry.in_flight

    def statistics(self) -> dict[str, int]:
        out = dict(self.stats)
        out["entry_in_flight"] = self.entry_in_flight
        out["verification_available"] = int(self._context.verify is not None)
        out.update(self.shadows.planner.statistics())
        return out

    # -- routing ------------------------------------------------------------------------

    def _rank(
        self, tokens: list[int], params: SamplingParams, now: float,
        chain: list[int] | None = None,
    ) -> list[Candidate]:
        """The request's candidates, best first (peers on probation are not among them)."""
        return self._rank_all(tokens, params, now, chain).candidates

    def _rank_all(
        self, tokens: list[int], params: SamplingParams, now: float,
        chain: list[int] | None = None,
    ) -> Ranked:
        load = self._engine.load()
        local = LocalState(
            self._context.self_id,
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
        ranked = self.router.rank_all(
            chain, len(tokens), params.max_new_tokens, local, self._table, now
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route of %d prompt tokens: %s", len(tokens),
                " | ".join(c.reason for c in ranked.candidates[:ROUTE_LOG_CANDIDATES]),
            )
        return ranked

    async def _route(self, request: GenerationRequest, deadline: float) -> Ranked:
        """The candidates to race, best first: ranked, then (peer/routing/decide.py)
        probed and ranked again when a probe is worth its round trips; and the peers on
        probation (for a shadow)."""
        tokens = list(request.token_ids)
        private = request.cache_salt is not None
        chain = self._engine.hasher.chain(tokens)
        if self._before_route is not None and not private:
            await self._before_route(tokens, chain, deadline)
        ranked, probation = self._rank_all(tokens, request.params, trio.current_time(), chain)
        reports = None  # after a probe, next_step answers with the candidates
        while isinstance(
            step := next_step(
                ranked, reports, trio.current_time(), router=self.router, table=self._table,
                settings=self._probe_settings, not_after=deadline, private=private,
            ),
            ProbeFirst,
        ):
            started = trio.current_time()
            reports = await probe_loads(self._host, step.round, self.stats)
            waited = trio.current_time() - started
            self.router.probe_waits.waited(waited, step.round.plan.rtt_s)
            self.stats["probe_wait_ms"] += round(waited * 1e3)
        if step.changed:
            self.stats["probe_changed_choice"] += 1
        return Ranked(step.candidates, probation)

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
        attempt = self._remote_attempt(candidate, prompt, params, request_id, deadline)
        self.stats["forwards"] += 1
        return attempt

    def _remote_attempt(
        self,
        candidate: Candidate,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        deadline: float,
    ) -> RemoteAttempt:
        """A forward (a request's or a shadow's: the same wire form); AttemptFailed if the
        wire cannot carry it."""
        return RemoteAttempt(
            host=self._host,
            table=self._table,
            peer_id=candidate.peer_id,
            request_id=request_id,
            prompt=prompt,
            params=params,
            vocab_size=self._engine.vocab_size,
            gap_s=token_gap_s(self._config, candidate),
            deadline=deadline,
        )
