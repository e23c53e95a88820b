"""Routing policies: rank every peer that could serve a request, best first, with the reason.

The router decides; it never sends anything (STYLE 3). ``Router.rank`` turns the prompt's
block-hash chain, this peer's exact local match and load, and the peer table into
``PeerEstimate`` records, and ``rank_estimates`` orders them under a ``Policy``. The
simulator feeds ``rank_estimates`` directly with exact matches, so both measure one code.

The cost model (policy COST), in seconds, for a peer with match ``m`` of ``p`` prompt
tokens and ``n`` new tokens::

    network  = ROUND_TRIPS_PER_FORWARD * rtt                (0 for the entry peer itself)
    queue    = queued_prompt_tokens / prefill_speed         (prefill work ahead of ours)
             + running_requests * n / decode_speed          (decode shared with running streams)
    prefill  = max(p - m, 1) / prefill_speed * (1 + busy)   (only the uncached suffix)
    decode   = n / decode_speed

``busy`` is the mean number of requests running per peer across the swarm (this peer's
view). The engine shares its compute between running requests, so a prefill delays each
of them by about its own length: ``(1 + busy)`` charges a miss for its own wait and for
the wait it imposes. An idle swarm makes it plain completion time; an overloaded one makes
cache misses expensive, which keeps affinity when capacity is what matters. (Measured in
the simulator at 16 peers: without it, ``cost`` spread requests to dodge stale queues,
fell to a 0.43 hit ratio and a 16 s mean TTFT at load 1.5, against 2.1 s for
``longest_prefix``; with it, 0.77 and 1.26 s.)

The entry peer adds its own forwards since a peer's last summary to that peer's load (their
prompt tokens to its queue, one running stream each), so a burst does not all land on one
stale favourite. A remote match comes from its Bloom
summary (walk until the first miss); the local match is exact. Unknown round-trip times
and speeds take priors. A peer that failed recently is ranked after the entry peer.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from typing import NamedTuple

from peer.config import Policy
from peer.peer_table import PeerTable

# Priors and bounds, each with its reason.
DEFAULT_RTT_PRIOR_S = 0.050  # unmeasured peer: a same-continent WAN round trip; on loopback
#   (~4 ms measured, notes/libp2p.md) it is pessimistic, so a measured peer beats an unknown one
DEFAULT_PREFILL_TOKENS_PER_S = 500.0  # SmolLM2-135M on 2 CPU cores: ~1 s for 512 tokens
DEFAULT_DECODE_TOKENS_PER_S = 15.0  # SmolLM2-135M on 2 CPU cores: 60-80 ms a token
ROUND_TRIPS_PER_FORWARD = 2  # one to negotiate the stream (multistream-select), one request
SPEED_NOISE_FACTOR = 2.0  # speeds measured on shared or busy CPUs vary ~2x run to run
#   (notes/model.md): a peer within this factor of ours is as fast as ours, not a reason to forward
MIN_TOKENS_PER_S = 1e-3  # floor on any speed, so a zero or garbage figure cannot divide by 0
FAILURE_BACKOFF_S = 10.0  # a peer that failed is tried only after the entry peer this long
MAX_TRACKED_FAILURES = 4096  # bounds the failure memory; far above any peer table's size
MAX_BLOCK_SIZE = 1024  # the bound PeerConfig.block_size has


class PeerEstimate(NamedTuple):
    """What the router believes about one candidate, everything the policies need.

    NamedTuples, not frozen dataclasses: rank() builds several per peer per request and a
    frozen dataclass costs ~2 us to build, a NamedTuple ~0.4 us.
    """

    peer_id: str
    is_local: bool
    match_blocks: int  # estimated (remote, Bloom) or exact (local)
    match_tokens: int
    queued_prompt_tokens: int  # including the entry peer's forwards since the last summary
    running_requests: int  # likewise
    prefill_tokens_per_s: float  # priors already applied where unknown
    decode_tokens_per_s: float
    rtt_s: float  # 0 for the entry peer
    rtt_known: bool = True
    speeds_known: bool = True
    forwards_since_summary: int = 0
    failed_s_ago: float | None = None  # seconds since a recent failure, None if none


class Cost(NamedTuple):
    """Estimated completion time of a request on one peer, by part (see module docstring)."""

    network_s: float
    queue_s: float
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.network_s + self.queue_s + self.prefill_s + self.decode_s


class Candidate(NamedTuple):
    """One ranked choice. ``cost`` and ``reason`` are computed on demand (rank() stays fast)."""

    peer_id: str
    is_local: bool
    match_blocks: int
    match_tokens: int
    cost_s: float  # estimated completion time, seconds (Cost.total_s)
    queue_s: float  # its load part (Cost.queue_s): what LEAST_LOADED ranks by
    policy: Policy
    estimate: PeerEstimate
    prompt_tokens: int
    max_new_tokens: int

    @property
    def cost(self) -> Cost:
        """The cost by part; the prefill part includes the miss charge of a busy swarm."""
        idle = _cost_of(self.estimate, self.prompt_tokens, self.max_new_tokens)
        prefill = self.cost_s - idle.network_s - idle.queue_s - idle.decode_s
        return Cost(idle.network_s, idle.queue_s, prefill, idle.decode_s)

    @property
    def matches_estimated(self) -> bool:
        """Whether remote matches were estimated (only COST and LONGEST_PREFIX need them)."""
        return self.is_local or self.policy in _USES_MATCHES

    @property
    def reason(self) -> str:
        """A human-readable account of how this candidate was judged."""
        return _reason(self)


class LocalState(NamedTuple):
    """The entry peer itself: its exact radix match for the prompt and its live load."""

    peer_id: str
    match_tokens: int  # Engine.local_match_tokens(prompt): whole blocks, exact
    queued_prompt_tokens: int
    running_requests: int
    prefill_tokens_per_s: float  # measured; <= 0 when not measured yet
    decode_tokens_per_s: float


def estimate_cost(
    match_tokens: int,
    prompt_tokens: int,
    max_new_tokens: int,
    queued_prompt_tokens: int,
    running_requests: int,
    prefill_tokens_per_s: float,
    decode_tokens_per_s: float,
    rtt_s: float,
    busy: float = 0.0,
) -> Cost:
    """Estimated completion time of a request on a peer (the model in the module docstring).

    Pure and cheap: the simulator calls it with exact matches.
    """
    prefill = max(prefill_tokens_per_s, MIN_TOKENS_PER_S)
    decode = max(decode_tokens_per_s, MIN_TOKENS_PER_S)
    decode_s = max_new_tokens / decode
    return Cost(
        ROUND_TRIPS_PER_FORWARD * rtt_s,
        queued_prompt_tokens / prefill + running_requests * decode_s,
        max(prompt_tokens - match_tokens, 1) / prefill * (1 + busy),
        decode_s,
    )


def _cost_of(estimate: PeerEstimate, prompt_tokens: int, max_new_tokens: int) -> Cost:
    return estimate_cost(
        estimate.match_tokens,
        prompt_tokens,
        max_new_tokens,
        estimate.queued_prompt_tokens,
        estimate.running_requests,
        estimate.prefill_tokens_per_s,
        estimate.decode_tokens_per_s,
        estimate.rtt_s,
    )


# NamedTuple's generated __new__ is a Python function (~0.4 us a call); tuple.__new__ with
# the fields in order builds the same record in half that. Used only where every field is
# written out next to the call.
_new = tuple.__new__
_USES_MATCHES = frozenset({Policy.COST, Policy.LONGEST_PREFIX})
_BY_ID = operator.itemgetter(0)
_BY_COST = operator.itemgetter(4)
_BY_QUEUE = operator.itemgetter(5)
_BY_MATCH = operator.itemgetter(2)


def rank_estimates(
    policy: Policy,
    estimates: Sequence[PeerEstimate],
    prompt_tokens: int,
    max_new_tokens: int,
    rng: random.Random,
    last_choice: str | None = None,
) -> list[Candidate]:
    """All candidates under ``policy``, best first; exactly one estimate must be local.

    Sorting policies place the local peer where it ranks: COST by cost; LONGEST_PREFIX by
    match, ties by load; LEAST_LOADED by load (remaining ties: local first, then peer id).
    RANDOM and ROUND_ROBIN pick the first among all peers and put the local peer last
    otherwise. LOCAL returns the local peer alone. Peers that failed recently come after
    the local peer. ``last_choice`` is ROUND_ROBIN's state: the peer it picked last time.
    """
    if prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(
            f"prompt_tokens and max_new_tokens must be >= 1, got {prompt_tokens}, {max_new_tokens}"
        )
    healthy, suspects = _candidates(
        policy, estimates, prompt_tokens, max_new_tokens, swarm_busy(estimates)
    )
    return _order(policy, healthy, suspects, rng, last_choice)


def _order(
    policy: Policy,
    healthy: list[Candidate],
    suspects: list[Candidate],
    rng: random.Random,
    last_choice: str | None,
) -> list[Candidate]:
    """rank_estimates' ordering of (healthy, suspects), each local first then by id."""
    if policy is Policy.RANDOM or policy is Policy.ROUND_ROBIN:
        return _pick_first(policy, healthy, suspects, rng, last_choice)
    for group in (healthy, suspects):
        # Stable sorts from the last tie-break to the first key: C-level keys, no tuples.
        if policy is Policy.COST:
            group.sort(key=_BY_COST)
        elif policy is Policy.LONGEST_PREFIX:
            group.sort(key=_BY_QUEUE)
            group.sort(key=_BY_MATCH, reverse=True)  # reverse keeps equal items in order
        elif policy is Policy.LEAST_LOADED:
            group.sort(key=_BY_QUEUE)
    return healthy + suspects


def swarm_busy(estimates: Sequence[PeerEstimate]) -> float:
    """Mean running requests per candidate: the `busy` of the cost model."""
    return sum(e.running_requests for e in estimates) / len(estimates) if estimates else 0.0


def _candidates(
    policy: Policy,
    estimates: Sequence[PeerEstimate],
    prompt_tokens: int,
    max_new_tokens: int,
    busy: float,
) -> tuple[list[Candidate], list[Candidate]]:
    """Candidates with costs, (healthy, failed recently), each ordered local first then by id.

    The arithmetic is estimate_cost's, inlined: this loop is most of a decision's time.
    """
    healthy: list[Candidate] = []
    suspects: list[Candidate] = []
    local: Candidate | None = None
    floor = MIN_TOKENS_PER_S
    trips = ROUND_TRIPS_PER_FORWARD
    only_local = policy is Policy.LOCAL
    for e in estimates:
        (peer_id, is_local, match_blocks, match_tokens, queued, running, prefill, decode, rtt,
         _, _, _, failed_s_ago) = e
        if only_local and not is_local:
            continue
        prefill = prefill if prefill > floor else floor
        decode = decode if decode > floor else floor
        decode_s = max_new_tokens / decode
        queue_s = queued / prefill + running * decode_s
        unmatched = prompt_tokens - match_tokens
        miss = (unmatched if unmatched > 1 else 1) / prefill * (1 + busy)
        cost_s = trips * rtt + queue_s + miss + decode_s
        candidate = _new(
            Candidate,
            (peer_id, is_local, match_blocks, match_tokens, cost_s, queue_s, policy, e,
             prompt_tokens, max_new_tokens),
        )
        if is_local:
            if local is not None:
                raise ValueError("exactly one estimate must be the local peer, got several")
            local = candidate
        elif failed_s_ago is None:
            healthy.append(candidate)
        else:
            suspects.append(candidate)
    if local is None:
        raise ValueError("exactly one estimate must be the local peer, got none")
    if only_local:
        return [local], []
    healthy.sort(key=_BY_ID)
    suspects.sort(key=_BY_ID)
    ids = {c.peer_id for c in healthy}
    ids.update(c.peer_id for c in suspects)
    ids.add(local.peer_id)
    if len(ids) != len(healthy) + len(suspects) + 1:
        raise ValueError("a peer appears twice among the estimates")
    healthy.insert(0, local)
    return healthy, suspects


def _pick_first(
    policy: Policy,
    healthy: list[Candidate],
    suspects: list[Candidate],
    rng: random.Random,
    last_choice: str | None,
) -> list[Candidate]:
    """RANDOM / ROUND_ROBIN: the first pick among all healthy peers, self last otherwise."""
    ordered = sorted(healthy, key=_BY_ID)
    if policy is Policy.RANDOM:
        rng.shuffle(ordered)
    elif last_choice is not None:
        # The cycle continues after the last pick, even if that peer has since left.
        start = next((i for i, c in enumerate(ordered) if c.peer_id > last_choice), 0)
        ordered = ordered[start:] + ordered[:start]
    first, rest = ordered[0], ordered[1:]
    if first.is_local:
        return [first, *rest, *suspects]
    return [
        first,
        *(c for c in rest if not c.is_local),
        *(c for c in rest if c.is_local),
        *suspects,
    ]


def _reason(c: Candidate) -> str:
    e, cost = c.estimate, c.cost
    who = "self" if e.is_local else "peer"
    if not c.matches_estimated:
        match = "match not estimated"
    elif e.is_local:
        match = f"exact match {e.match_blocks} blocks"
    else:
        match = f"~{e.match_blocks} blocks matched (Bloom)"
    parts = [
        f"{who} {e.peer_id} [{c.policy.value}]: {match}",
        f"cost {c.cost_s:.3f} s = net {cost.network_s:.3f} + queue {cost.queue_s:.3f}"
        f" + prefill {cost.prefill_s:.3f} + decode {cost.decode_s:.3f}",
        f"load {e.running_requests} running, {e.queued_prompt_tokens} queued tokens",
    ]
    if e.forwards_since_summary:
        parts.append(f"incl. {e.forwards_since_summary} forward(s) since its summary")
    if not e.is_local:
        rtt = f"rtt {e.rtt_s * 1000:.1f} ms"
        parts.append(rtt if e.rtt_known else rtt + " (prior)")
    if not e.speeds_known:
        parts.append("speeds from prior")
    if e.failed_s_ago is not None:
        parts.append(f"failed {e.failed_s_ago:.1f} s ago, tried after self")
    return "; ".join(parts)


class RouterStatistics(NamedTuple):
    ranks: int
    first_local: int
    first_remote: int
    failures_recorded: int
    successes_recorded: int


def _as_measured_here(remote: float, ours: float) -> float:
    """A remote peer's advertised speed as this peer uses it: unknown (<= 0) or within
    SPEED_NOISE_FACTOR of ours counts as ours. Measurement noise then cannot pull every
    request to whichever peer happened to measure itself fastest; a peer that is really
    faster (another CPU class, a GPU) still attracts the work its speed deserves."""
    if remote <= 0 or ours / SPEED_NOISE_FACTOR <= remote <= ours * SPEED_NOISE_FACTOR:
        return ours
    return remote


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
        """Every live peer and this one as candidates, best first (see rank_estimates).

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
            return self.rank_estimates([self.local_estimate(local)], prompt_tokens, max_new_tokens)
        healthy, suspects = self._table_candidates(
            chain, prompt_tokens, max_new_tokens, local, table, now
        )
        return self._chose(_order(self.policy, healthy, suspects, self._rng, self._last_choice))

    def _table_candidates(
        self,
        chain: Sequence[int],
        prompt_tokens: int,
        max_new_tokens: int,
        local: LocalState,
        table: PeerTable,
        now: float,
    ) -> tuple[list[Candidate], list[Candidate]]:
        """rank_estimates' _candidates for the local peer and the table's live peers, built
        in one pass from `PeerTable.routing_rows` (already unique and ordered by id)."""
        policy = self.policy
        rows = table.routing_rows(chain if policy in _USES_MATCHES else None, now)
        block_size = self.block_size
        rtt_prior = self._rtt_prior_s
        failed = self._failed_at
        floor = MIN_TOKENS_PER_S
        trips = ROUND_TRIPS_PER_FORWARD
        local_e = self.local_estimate(local)
        # Speed priors for peers that have not measured theirs: ours, else the defaults.
        prefill_prior, decode_prior = local_e.prefill_tokens_per_s, local_e.decode_tokens_per_s
        local_id = local.peer_id
        busy = (
            local.running_requests + sum(row[1].running_requests + row[3] for row in rows)
        ) / (1 + len(rows))
        miss_weight = 1 + busy
        healthy = _candidates(policy, (local_e,), prompt_tokens, max_new_tokens, busy)[0]
        suspects: list[Candidate] = []
        for peer_id, summary, rtt, forwards, forwarded_tokens, match_blocks in rows:
            if peer_id == local_id:
                continue  # the table never holds us; a shell mistake must not duplicate us
            prefill_s = summary.prefill_tokens_per_s
            decode_s = summary.decode_tokens_per_s
            speeds_known = prefill_s > 0 and decode_s > 0
            prefill = _as_measured_here(prefill_s, prefill_prior)
            decode = _as_measured_here(decode_s, decode_prior)
            queued = summary.queued_prompt_tokens + forwarded_tokens
            running = summary.running_requests + forwards
            rtt_known = rtt is not None
            if rtt is None:
                rtt = rtt_prior
            failed_s_ago = self.failed_s_ago(peer_id, now) if peer_id in failed else None
            match_tokens = match_blocks * block_size
            e = _new(
                PeerEstimate,
                (peer_id, False, match_blocks, match_tokens, queued, running, prefill, decode,
                 rtt, rtt_known, speeds_known, forwards, failed_s_ago),
            )
            # The arithmetic of _candidates (estimate_cost's), inlined likewise.
            prefill = prefill if prefill > floor else floor
            decode = decode if decode > floor else floor
            decode_time = max_new_tokens / decode
            queue_s = queued / prefill + running * decode_time
            unmatched = prompt_tokens - match_tokens
            miss = (unmatched if unmatched > 1 else 1) / prefill * miss_weight
            cost_s = trips * rtt + queue_s + miss
            candidate = _new(
                Candidate,
                (peer_id, False, match_blocks, match_tokens, cost_s + decode_time, queue_s,
                 policy, e, prompt_tokens, max_new_tokens),
            )
            if failed_s_ago is None:
                healthy.append(candidate)
            else:
                suspects.append(candidate)
        return healthy, suspects

    def record_outcome(self, peer_id: str, ok: bool, now: float) -> None:
        """What came of trying ``peer_id``: a failure ranks it after self for a while."""
        if ok:
            self._successes += 1
            self._failed_at.pop(peer_id, None)
            return
        self._failures += 1
        self._failed_at.pop(peer_id, None)  # re-insert: the dict stays ordered by time
        self._failed_at[peer_id] = now
        self._forget_failures(now)

    def failed_s_ago(self, peer_id: str, now: float) -> float | None:
        """Seconds since ``peer_id`` last failed, if within the backoff; else None."""
        at = self._failed_at.get(peer_id)
        if at is None or now - at >= self._failure_backoff_s:
            return None
        return now - at

    def _forget_failures(self, now: float) -> None:
        while self._failed_at:
            peer_id, at = next(iter(self._failed_at.items()))
            if now - at < self._failure_backoff_s and len(self._failed_at) <= MAX_TRACKED_FAILURES:
                break
            del self._failed_at[peer_id]

    def local_estimate(self, local: LocalState) -> PeerEstimate:
        """The entry peer as a candidate: exact match, live load, no network."""
        prefill, decode = local.prefill_tokens_per_s, local.decode_tokens_per_s
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
        )

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            self._ranks,
            self._first_local,
            self._ranks - self._first_local,
            self._failures,
            self._successes,
        )

