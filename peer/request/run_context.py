"""What every request run of one pipeline shares, and where each attempt's outcome is
recorded (`RunContext`): the router backs off a failed peer and learns what a forward
cost (peer/routing/forward_overhead.py), the trust ledger learns each answer, claim,
speed and lapse, requests waiting on the same peer's first token move on, a quarantine
is carried out. peer/request/run.py's `RequestRun` calls it at each step of a request.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import trio

from peer.config import PeerConfig
from peer.engine.api import GeneratingEngine
from peer.engine.speeds import forward_speeds
from peer.request.forward import AttemptFailed, Faulty, HedgeLost, MovedOn, RemoteAttempt
from peer.request.generation import Attempt, Outcome
from peer.request.race import Racer, Waiters
from peer.routing.claims import claimed_decode, priced_stream_decode
from peer.routing.cost import PeerEstimate
from peer.routing.reliability import Lapse
from peer.routing.router import Candidate, Router
from peer.routing.trust import Promote, Quarantine, TrustLedger
from peer.swarm.peer_table import PeerTable
from protocols.answers import Evidence

logger = logging.getLogger(__name__)


class WrongOutput(AttemptFailed):
    """An answer that failed its verification here."""

    def __init__(self, detail: str) -> None:
        super().__init__(Outcome.WRONG_OUTPUT, detail)



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
    if isinstance(exc, (MovedOn, Faulty, WrongOutput)):
        return None
    if exc.outcome is Outcome.STALLED:
        return Lapse.STALLED
    if exc.outcome is Outcome.FAILED:
        return Lapse.FAILED
    return None
