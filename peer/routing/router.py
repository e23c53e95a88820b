"""Routing: rank every peer that could serve a request, best first, with the reason.

The router decides; it never sends anything (STYLE 3). ``Router.rank`` turns the prompt's
block-hash chain, this peer's exact local match and load, and the peer table into
``PeerEstimate`` records and orders them with the ranking core (peer/routing/cost.py: the
cost model and each policy's order), remembering round-robin state and recent failures.

The entry peer adds its own forwards in flight since a peer's last summary to that peer's
load (their prompt tokens to its queue until their first token, one running stream each
until they end), so a burst does not all land on one stale favourite. A remote match
comes from its Bloom summary (walk until the first miss); the local match is exact.
Unknown round-trip times and speeds take priors. A peer that failed recently is ranked
after the entry peer, for a backoff that doubles with each consecutive failure.

With a `TrustLedger` (peer/routing/trust.py) and ``require_rtt`` (what a serving peer uses), only
peers that proved reachable (a round trip measured here) and are not quarantined are
candidates; claimed matches are multiplied by the ledger's discount, advertised speeds and
batch shapes count only as far as evidence allows (peer/routing/claims.py: up to twice the
best observed and never above the claim, else up to ours), a peer whose lapses put it in
debt ranks after the entry peer like one that failed, and peers on probation are never
candidates: `rank_all` returns them apart, best first, for shadow verification
(peer/routing/shadow.py).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from peer.config import Policy
from peer.routing.claims import believed_batch, believed_speeds, claimed_decode
from peer.routing.cost import (
    BATCH_STEP_SLOPE,
    COPY_CHARGE,
    MIN_TOKENS_PER_S,
    ROUND_TRIPS_PER_FORWARD,
    SPEED_NOISE_FACTOR,
    USES_MATCHES,
    Candidate,
    Cost,
    LocalState,
    PeerEstimate,
    aged_queue,
    as_measured_here,
    candidates_of,
    estimate_cost,
    forward_network_s,
    order_candidates,
    rank_estimates,
    single_stream_decode,
    swarm_busy,
)
from peer.routing.forward_overhead import ForwardOverhead
from peer.routing.probing import ProbeWaits, fresh_estimate
from peer.routing.trust import TrustLedger
from peer.swarm.peer_table import PeerTable
from protocols.load import LoadReport

__all__ = [
    "BATCH_STEP_SLOPE",
    "COPY_CHARGE",
    "MIN_TOKENS_PER_S",
    "ROUND_TRIPS_PER_FORWARD",
    "SPEED_NOISE_FACTOR",
    "Candidate",
    "Cost",
    "LocalState",
    "PeerEstimate",
    "Ranked",
    "Router",
    "RouterStatistics",
    "build_router",
    "estimate_cost",
    "rank_estimates",
    "swarm_busy",
]

# Priors and bounds, each with its reason.
DEFAULT_RTT_PRIOR_S = 0.050  # unmeasured peer: a same-continent WAN round trip; on loopback
#   (~4 ms measured, docs/libp2p.md) it is pessimistic, so a measured peer beats an unknown one
DEFAULT_PREFILL_TOKENS_PER_S = 500.0  # SmolLM2-135M on 2 CPU cores: ~1 s for 512 tokens
DEFAULT_DECODE_TOKENS_PER_S = 15.0  # SmolLM2-135M on 2 CPU cores: 60-80 ms a token
FAILURE_BACKOFF_S = 10.0  # a peer that failed is tried only after the entry peer this long
MAX_FAILURE_BACKOFF_S = 600.0  # the backoff doubles per consecutive failure up to this: a
#   peer that keeps stalling costs a try every 10 minutes, not every 10 s
MAX_TRACKED_FAILURES = 4096  # bounds the failure memory; far above any peer table's size
MAX_BLOCK_SIZE = 1024  # the bound PeerConfig.block_size has

_new = tuple.__new__  # see peer/routing/cost.py: builds a NamedTuple at half the cost
_MATCH_BLOCKS = operator.itemgetter(5)  # a routing_rows row's matched blocks


class RouterStatistics(NamedTuple):
    ranks: int
    first_local: int
    first_remote: int
    failures_recorded: int
    successes_recorded: int
    unproven_skipped: int = 0  # candidates left out: no round trip measured yet
    quarantined_skipped: int = 0
    probation_held_back: int = 0  # probation peers left out of a request's candidates


class Ranked(NamedTuple):
    """`Router.rank_all`: a request's candidates, and its peers on probation apart."""

    candidates: list[Candidate]  # best first; the entry peer is always among them
    probation: list[Candidate]  # never serve a client; best first (healthy, then by cost)


class Router:
    """Ranks candidates for each request under one policy; remembers failures and RR state."""

    def __init__(
        self,
        policy: Policy,
        rng: random.Random,
        *,
        block_size: int,
        rtt_prior_s: float = DEFAULT_RTT_PRIOR_S,
        default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        default_decode_tokens_per_s: float = DEFAULT_DECODE_TOKENS_PER_S,
        failure_backoff_s: float = FAILURE_BACKOFF_S,
        trust: TrustLedger | None = None,
        require_rtt: bool = False,
    ) -> None:
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be a Policy, got {policy!r}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        if rtt_prior_s < 0 or failure_backoff_s < 0:
            raise ValueError("rtt_prior_s and failure_backoff_s must be >= 0")
        if default_prefill_tokens_per_s <= 0 or default_decode_tokens_per_s <= 0:
            raise ValueError("default speeds must be > 0")
        self.policy = policy
        self.block_size = block_size
        self._rng = rng
        self._rtt_prior_s = rtt_prior_s
        self._default_prefill = default_prefill_tokens_per_s
        self._default_decode = default_decode_tokens_per_s
        self._failure_backoff_s = failure_backoff_s
        self._failed_at: dict[str, float] = {}
        self._fail_streak: dict[str, int] = {}  # consecutive failures, per peer in _failed_at
        self.trust = trust
        self.forward_overhead = ForwardOverhead()  # a forward's time here beyond the model
        self.probe_waits = ProbeWaits()  # what a load probe round holds a request here
        self._require_rtt = require_rtt
        self._unproven = 0
        self._quarantined = 0
        self._held_back = 0
        self._last_choice: str | None = None
        self._ranks = 0
        self._first_local = 0
        self._failures = 0
        self._successes = 0

    def rank_estimates(
        self, estimates: Sequence[PeerEstimate], prompt_tokens: int, max_new_tokens: int
    ) -> list[Candidate]:
        """rank_estimates() under this router's policy, rng and round-robin state."""
        ranked = rank_estimates(
            self.policy, estimates, prompt_tokens, max_new_tokens, self._rng, self._last_choice
        )
        return self._chose(ranked)

    def _chose(self, ranked: list[Candidate]) -> list[Candidate]:
        self._ranks += 1
        self._first_local += ranked[0].is_local
        if self.policy is Policy.ROUND_ROBIN:
            self._last_choice = ranked[0].peer_id
        return ranked

    def rank(
        self,
        chain: Sequence[int],
        prompt_tokens: int,
        max_new_tokens: int,
        local: LocalState,
        table: PeerTable,
        now: float,
    ) -> list[Candidate]:
        """Every live trusted peer and this one as candidates, best first (see
        rank_estimates; `rank_all` has the arguments and the peers on probation)."""
        return self.rank_all(chain, prompt_tokens, max_new_tokens, local, table, now).candidates

    def rank_all(
        self,
        chain: Sequence[int],
        prompt_tokens: int,
        max_new_tokens: int,
        local: LocalState,
        table: PeerTable,
        now: float,
    ) -> Ranked:
        """Every live peer and this one as candidates, best first (see rank_estimates),
        except peers on probation: those come apart, ranked by the same cost.

        ``chain`` is the prompt's block-hash chain (BlockHasher.chain of its tokens).
        Remote matches are Bloom estimates, taken only by the policies that use them.
        """
        if len(chain) * self.block_size > prompt_tokens:
            raise ValueError(
                f"a chain of {len(chain)} blocks of {self.block_size} is longer than the "
                f"prompt's {prompt_tokens} tokens"
            )
        if not 0 <= local.match_tokens <= prompt_tokens:
            raise ValueError(f"local match {local.match_tokens} outside [0, {prompt_tokens}]")
        if self.policy is Policy.LOCAL or prompt_tokens < 1 or max_new_tokens < 1:
            only = self.rank_estimates([self.local_estimate(local)], prompt_tokens,
                                       max_new_tokens)
            return Ranked(only, [])
        healthy, suspects, probation = self._table_candidates(
            chain, prompt_tokens, max_new_tokens, local, table, now
        )
        ordered = order_candidates(self.policy, healthy, suspects, self._rng, self._last_choice)
        self._held_back += len(probation)
        probation.sort(key=lambda c: (c.estimate.failed_s_ago is not None, c.cost_s, c.peer_id))
        return Ranked(self._chose(ordered), probation)

    def rerank(
        self,
        ranked: Sequence[Candidate],
        reports: Mapping[str, LoadReport],
        table: PeerTable,
        now: float,
    ) -> list[Candidate]:
        """``ranked`` (this router's rank()) ranked again with the fresh load of
        ``reports`` (peer/routing/probing.py), each floored by this peer's own forwards there.
        The same candidates, never another; one quarantined meanwhile drops out.

        (Choosing only among the candidates with fresh load, and keeping the rest as
        fallbacks, was measured too: no difference in the simulator, docs/cost-model.md.)
        """
        if not ranked:
            raise ValueError("nothing to rank again")
        trust = self.trust
        estimates: list[PeerEstimate] = []
        for c in ranked:
            e = c.estimate
            if not c.is_local and trust is not None and trust.routing(c.peer_id) is None:
                self._quarantined += 1
                continue
            report = None if c.is_local else reports.get(c.peer_id)
            if report is not None:
                view = table.get(c.peer_id, now)
                own = (
                    (view.forwards_since_summary, view.forwarded_prompt_tokens)
                    if view is not None
                    else (e.forwards_since_summary, 0)
                )
                e = fresh_estimate(e, report, *own)
            estimates.append(e)
        first = ranked[0]
        return self.rank_estimates(estimates, first.prompt_tokens, first.max_new_tokens)

    def _table_candidates(
        self,
        chain: Sequence[int],
        prompt_tokens: int,
        max_new_tokens: int,
        local: LocalState,
        table: PeerTable,
        now: float,
    ) -> tuple[list[Candidate], list[Candidate], list[Candidate]]:
        """rank_estimates' _candidates for the local peer and the table's live peers, built
        in one pass from `PeerTable.routing_rows` (already unique and ordered by id), and
        the peers on probation apart."""
        policy = self.policy
        rows = table.routing_rows(chain if policy in USES_MATCHES else None, now)
        overhead = self.forward_overhead
        block_size = self.block_size
        rtt_prior = self._rtt_prior_s
        failed = self._failed_at
        local_e = self.local_estimate(local)
        # Speed priors for peers that have not measured theirs: ours, else the defaults.
        prefill_prior, decode_prior = local_e.prefill_tokens_per_s, local_e.decode_tokens_per_s
        local_id = local.peer_id
        busy = (
            local.running_requests + sum(row[1].running_requests + row[3] for row in rows)
        ) / (1 + len(rows))
        remote_best = max(map(_MATCH_BLOCKS, rows), default=0)
        best_match = max(local.match_tokens, remote_best * block_size)
        holder_network_s = 0.0
        if best_match > local.match_tokens:  # the nearest holder of the longest match
            holder_network_s = min(
                forward_network_s(rtt_prior if row[2] is None else row[2],
                                  overhead.extra_for(row[0]))
                for row in rows if row[5] == remote_best
            )
        healthy = candidates_of(
            policy, (local_e,), prompt_tokens, max_new_tokens, busy, best_match,
            holder_network_s,
        )[0]
        suspects: list[Candidate] = []
        trust = self.trust
        probation: list[Candidate] = []
        for (peer_id, summary, rtt, forwards, forwarded_tokens, match_blocks, age_s,
             queue_mean) in rows:
            if peer_id == local_id:
                continue  # the table never holds us; a shell mistake must not duplicate us
            if rtt is None and self._require_rtt:
                self._unproven += 1  # never completed a ping with us: not a candidate
                continue
            observed_prefill = observed_decode = 0.0
            demoted = False
            lapsed_at = now
            on_probation = False
            if trust is not None:
                standing = trust.routing(peer_id)
                if standing is None:
                    self._quarantined += 1
                    continue
                (on_probation, factor, observed_prefill, observed_decode, demoted_until,
                 lapsed_at) = standing
                demoted = now < demoted_until
                if factor < 1.0:
                    match_blocks = int(match_blocks * factor)
                believed = believed_speeds(
                    summary.prefill_tokens_per_s, summary.decode_tokens_per_s,
                    summary.batch_decode_tokens_per_s, observed_prefill, observed_decode,
                    prefill_prior, decode_prior,
                )
                prefill_s, decode_s, speeds_known = believed
                slots, step_tokens = believed_batch(
                    summary.batch_slots, summary.step_tokens, local.batch_slots,
                    local.step_tokens,
                )
            else:  # no ledger: every peer on its claims (build_router)
                prefill_s = summary.prefill_tokens_per_s
                decode_s = claimed_decode(
                    summary.decode_tokens_per_s, summary.batch_decode_tokens_per_s
                )
                speeds_known = prefill_s > 0 and decode_s > 0
                slots, step_tokens = summary.batch_slots, summary.step_tokens
            prefill = as_measured_here(prefill_s, prefill_prior)
            decode = as_measured_here(decode_s, decode_prior)
            queued = round(aged_queue(summary.queued_prompt_tokens, queue_mean,
                                      summary.prefill_tokens_per_s, age_s)) + forwarded_tokens
            running = summary.running_requests + forwards
            rtt_known = rtt is not None
            if rtt is None:
                rtt = rtt_prior
            failed_s_ago = self.failed_s_ago(peer_id, now) if peer_id in failed else None
            if failed_s_ago is None and demoted:
                failed_s_ago = max(0.0, now - lapsed_at)
            match_tokens = match_blocks * block_size
            extra_s = overhead.extra_for(peer_id)
            e = _new(
                PeerEstimate,
                (peer_id, False, match_blocks, match_tokens, queued, running, prefill, decode,
                 rtt, rtt_known, speeds_known, forwards, failed_s_ago, slots, step_tokens,
                 extra_s),
            )
            network_s, queue_s, miss_s, decode_time = estimate_cost(
                match_tokens, prompt_tokens, max_new_tokens, queued, running, prefill, decode,
                rtt, busy, best_match, slots, step_tokens, extra_s=extra_s,
            )
            candidate = _new(
                Candidate,
                (peer_id, False, match_blocks, match_tokens,
                 network_s + queue_s + miss_s + decode_time, queue_s,
                 policy, e, prompt_tokens, max_new_tokens),
            )
            if on_probation:
                probation.append(candidate)
            elif failed_s_ago is None:
                healthy.append(candidate)
            else:
                suspects.append(candidate)
        return healthy, suspects, probation

    def record_outcome(self, peer_id: str, ok: bool, now: float) -> None:
        """What came of trying ``peer_id``: a failure ranks it after self for a while
        (``failure_backoff_s``, doubled per consecutive failure up to MAX_FAILURE_BACKOFF_S)."""
        if ok:
            self._successes += 1
            self._failed_at.pop(peer_id, None)
            self._fail_streak.pop(peer_id, None)
            return
        self._failures += 1
        self._failed_at.pop(peer_id, None)  # re-insert: the dict stays ordered by time
        self._failed_at[peer_id] = now
        self._fail_streak[peer_id] = self._fail_streak.get(peer_id, 0) + 1
        self._forget_failures(now)

    def backoff_s(self, peer_id: str) -> float:
        """How long after its last failure ``peer_id`` ranks after the entry peer."""
        streak = self._fail_streak.get(peer_id, 1)
        return min(self._failure_backoff_s * 2.0 ** min(streak - 1, 30), MAX_FAILURE_BACKOFF_S)

    def failed_s_ago(self, peer_id: str, now: float) -> float | None:
        """Seconds since ``peer_id`` last failed, if within the backoff; else None."""
        at = self._failed_at.get(peer_id)
        if at is None or now - at >= self.backoff_s(peer_id):
            return None
        return now - at

    def _forget_failures(self, now: float) -> None:
        longest = max(self._failure_backoff_s, MAX_FAILURE_BACKOFF_S)
        while self._failed_at:
            peer_id, at = next(iter(self._failed_at.items()))
            if now - at < longest and len(self._failed_at) <= MAX_TRACKED_FAILURES:
                break
            del self._failed_at[peer_id]
            self._fail_streak.pop(peer_id, None)

    def local_estimate(self, local: LocalState) -> PeerEstimate:
        """The entry peer as a candidate: exact match, live load, no network."""
        prefill = local.prefill_tokens_per_s
        decode = single_stream_decode(local.decode_tokens_per_s, local.batch_decode_tokens_per_s)
        return PeerEstimate(
            local.peer_id,
            True,
            local.match_tokens // self.block_size,
            local.match_tokens,
            local.queued_prompt_tokens,
            local.running_requests,
            prefill if prefill > 0 else self._default_prefill,
            decode if decode > 0 else self._default_decode,
            0.0,
            True,
            prefill > 0 and decode > 0,
            batch_slots=local.batch_slots,
            step_tokens=local.step_tokens,
        )

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            self._ranks,
            self._first_local,
            self._ranks - self._first_local,
            self._failures,
            self._successes,
            self._unproven,
            self._quarantined,
            self._held_back,
        )


def build_router(
    policy: Policy,
    rng: random.Random,
    *,
    block_size: int,
    trust: TrustLedger | None = None,
) -> Router:
    """The router a peer ranks with, for the live peer and the simulator alike.

    With `trust` (the serving peer's ledger) only peers that proved reachable (a round trip
    measured here) and are not quarantined are candidates, their claims and speeds weighed
    by what was observed; without it, every peer in the table is, on its claims."""
    return Router(policy, rng, block_size=block_size, trust=trust, require_rtt=trust is not None)
