"""The ranking core of routing: records, the cost model, and the order under each policy.

Pure and fast: ``rank_estimates`` orders ``PeerEstimate`` records under a ``Policy``;
``peer/routing/router.py``'s ``Router`` builds those records from the peer table, and the
simulator feeds them with exact matches, so both measure one code. ``estimate_cost`` is
the one copy of the cost model (policy COST): a request's completion time on a peer as
network + queue + prefill + decode; docs/cost-model.md has the formula, each term's
reason and the measurements behind them.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Sequence
from typing import NamedTuple

from peer.config import Policy

# Bounds of the cost model, each with its reason.
ROUND_TRIPS_PER_FORWARD = 1  # the request and its first token: the stream's negotiation
#   travels with the request (peer/net/lazy_select.py)
STREAM_SETUP_ROUND_TRIPS = 1  # any other new stream: its negotiation, before it carries a byte
SPEED_NOISE_FACTOR = 2.0  # speeds measured on shared or busy CPUs vary ~2x run to run
#   (docs/model.md): a peer within this factor of ours is as fast as ours, not a reason to forward
# Costs this close to the cheapest are a tie: the estimates carry more noise than that
# (speeds are EWMAs of samples ~2x apart, round trips jitter by a millisecond), and a tie
# goes to the longest match: serving a prefix where it is cached keeps it in one cache,
# where a miss elsewhere copies it into a second one and evicts other prefixes there, a
# cost the model does not price.
COST_TIE_FRACTION = 0.10
COPY_CHARGE = 1.0  # a prefix copied from another peer's cache evicts about as much here,
#   computed again later: charged its prefill once (docs/cost-model.md)
MIN_TOKENS_PER_S = 1e-3  # floor on any speed, so a zero or garbage figure cannot divide by 0
# A batched decode step of b sequences takes (1 - slope + slope * b) lone steps: the
# weights are read once per step, each sequence adds its own attention and sampling.
# Fitted to bench.engine's concurrency sweeps on this CPU (docs/cost-model.md: 0.09 to 0.17
# across three runs); the simulator's batching server uses the same figure by default.
BATCH_STEP_SLOPE = 0.12


# NamedTuple's generated __new__ is a Python function (~0.4 us a call); tuple.__new__ with
# the fields in order builds the same record in half that. Used only where every field is
# written out next to the call.
_new = tuple.__new__


class PeerEstimate(NamedTuple):
    """What the router believes about one candidate, everything the policies need.

    NamedTuples, not frozen dataclasses: rank() builds several per peer per request and a
    frozen dataclass costs ~2 us to build, a NamedTuple ~0.4 us.
    """

    peer_id: str
    is_local: bool
    match_blocks: int  # estimated (remote, Bloom) or exact (local)
    match_tokens: int
    queued_prompt_tokens: int  # including the entry peer's forwards in flight since its summary
    running_requests: int  # likewise
    prefill_tokens_per_s: float  # priors already applied where unknown
    decode_tokens_per_s: float
    rtt_s: float  # 0 for the entry peer
    rtt_known: bool = True
    speeds_known: bool = True
    forwards_since_summary: int = 0
    failed_s_ago: float | None = None  # seconds since a recent failure, None if none
    batch_slots: int = 0  # 0: does not batch (processor sharing); else its max batch
    step_tokens: int = 0  # a batching peer's tokens per step (0: unknown, chunks not priced)
    extra_s: float = 0.0  # a forward's time at its entry (peer/routing/forward_overhead.py)


class Cost(NamedTuple):
    """Estimated completion time of a request on one peer, by part (docs/cost-model.md)."""

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
        """The cost by part; the prefill part includes the miss charge of a busy swarm and
        the copy charge."""
        return self.cost_and_charges()[0]

    def cost_and_charges(self) -> tuple[Cost, float]:
        """The cost by part, and how much of its prefill part is the copy and busy charges
        (what the prefill costs other requests, not its own time): both are the priced
        cost against the same estimate priced with neither."""
        idle = _cost_of(self.estimate, self.prompt_tokens, self.max_new_tokens)
        prefill = self.cost_s - idle.network_s - idle.queue_s - idle.decode_s
        return Cost(idle.network_s, idle.queue_s, prefill, idle.decode_s), prefill - idle.prefill_s

    @property
    def matches_estimated(self) -> bool:
        """Whether remote matches were estimated (only COST and LONGEST_PREFIX need them)."""
        return self.is_local or self.policy in USES_MATCHES

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
    decode_tokens_per_s: float  # one stream's, at the batch it was measured in
    batch_decode_tokens_per_s: float = 0.0  # all streams together (0: not measured)
    batch_slots: int = 0  # Engine.max_running (0: does not batch)
    step_tokens: int = 0  # Engine.step_tokens


def batch_share(running_requests: int, batch_slots: int, slope: float = BATCH_STEP_SLOPE) -> float:
    """How many lone decodes of our own length the running streams cost a new request.

    Processor sharing (``batch_slots`` 0): one per running stream. A batch with a free
    slot: the marginal slowdown of the batch, ``2 * slope * r`` (our steps longer by
    ``slope * r``, and each of the ``r`` others' by ``slope``). With every slot taken, the
    request also waits for a slot: about one request's decode at a full batch per
    ``batch_slots`` requests ahead of it.
    """
    if batch_slots <= 0:
        return float(running_requests)
    in_batch = running_requests if running_requests < batch_slots else batch_slots
    share = 2.0 * slope * in_batch
    ahead = running_requests + 1 - batch_slots
    if ahead > 0:
        share += ahead / batch_slots * (1.0 - slope + slope * batch_slots)
    return share


def single_stream_decode(
    decode_tokens_per_s: float, batch_decode_tokens_per_s: float, slope: float = BATCH_STEP_SLOPE
) -> float:
    """A lone stream's decode speed, from one stream's and the whole batch's speed measured
    together (their ratio is the batch they were measured at). Unknown figures (<= 0)
    leave ``decode_tokens_per_s`` as it is."""
    if decode_tokens_per_s <= 0 or batch_decode_tokens_per_s <= decode_tokens_per_s:
        return decode_tokens_per_s
    batch = batch_decode_tokens_per_s / decode_tokens_per_s
    return decode_tokens_per_s * (1.0 - slope + slope * batch)


def forward_network_s(rtt_s: float, extra_s: float) -> float:
    """A forward's network time as the model prices it: its round trips, plus what
    forwards were seen to take at their entry beyond them (forward_overhead.py)."""
    return ROUND_TRIPS_PER_FORWARD * rtt_s + extra_s


def aged_queue(reported: float, usual: float, prefill_tokens_per_s: float,
               age_s: float) -> float:
    """A peer's queued prompt tokens as the router believes them `age_s` after its summary
    reported `reported`: the report, moving toward `usual` (the mean of the peer's own
    reports) by exp(-age / turnover), where turnover is the time the peer takes to read
    the larger of the two at the prefill speed its summary claims.

    A queue changes within its turnover (a GPU reads a few hundred tokens in tens of
    milliseconds; summaries come every second or two), so an old report says little
    about the queue now beyond what the peer usually has, and the router that takes the
    lowest reports at face value picks the most wrong ones, as every other entry does
    (docs/cost-model.md). Fresh reports stand; old ones count as the peer's usual queue.
    """
    if age_s <= 0.0:
        return reported
    turnover_s = max(reported, usual, 1.0) / max(prefill_tokens_per_s, MIN_TOKENS_PER_S)
    weight = math.exp(-age_s / turnover_s)
    return weight * reported + (1.0 - weight) * usual


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
    best_match_tokens: int = 0,
    batch_slots: int = 0,
    step_tokens: int = 0,
    holder_network_s: float = 0.0,
    extra_s: float = 0.0,
) -> Cost:
    """Estimated completion time of a request on a peer (the model of docs/cost-model.md).

    ``best_match_tokens`` is the longest match among the candidates (0: no copy charge).
    ``holder_network_s`` (the entry peer's own candidate only; 0 elsewhere) is what a
    forward to that longest match costs in network time: when it is at least this peer's
    recomputation of the unmatched tokens, the copy charge is waived (the REPLICATE rule).
    ``extra_s`` (remote candidates only) is what forwards were seen to take beyond this
    model (peer/routing/forward_overhead.py), counted as network time.
    The one copy of the formula: the ranking loops, the router and the simulator call it.
    """
    prefill = prefill_tokens_per_s if prefill_tokens_per_s > MIN_TOKENS_PER_S else MIN_TOKENS_PER_S
    decode = decode_tokens_per_s if decode_tokens_per_s > MIN_TOKENS_PER_S else MIN_TOKENS_PER_S
    decode_s = max_new_tokens / decode
    unmatched = prompt_tokens - match_tokens
    if unmatched < 1:
        unmatched = 1
    copied = best_match_tokens - match_tokens
    if copied > 0 and holder_network_s * prefill < unmatched:
        miss = unmatched + COPY_CHARGE * copied
    else:  # nothing to copy, or cheaper to replicate here than to share from there
        miss = unmatched
    if batch_slots <= 0:
        queue_s = queued_prompt_tokens / prefill + running_requests * decode_s
    else:
        queue_s = queued_prompt_tokens / prefill + batch_share(
            running_requests, batch_slots
        ) * decode_s
        in_batch = running_requests if running_requests < batch_slots else batch_slots
        if in_batch and step_tokens > 0:
            per_step = step_tokens - in_batch if step_tokens - in_batch > 1 else 1
            steps = -(-unmatched // per_step)
            queue_s += steps * BATCH_STEP_SLOPE * in_batch / decode
    return _new(
        Cost,
        (forward_network_s(rtt_s, extra_s), queue_s, miss * (1 + busy) / prefill, decode_s),
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
        batch_slots=estimate.batch_slots,
        step_tokens=estimate.step_tokens,
        extra_s=estimate.extra_s,
    )


USES_MATCHES = frozenset({Policy.COST, Policy.LONGEST_PREFIX})
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

    Sorting policies place the local peer where it ranks: COST by cost (a near tie goes to
    the longest match); LONGEST_PREFIX by match, ties by load; LEAST_LOADED by load
    (remaining ties: local first, then peer id).
    RANDOM and ROUND_ROBIN pick the first among all peers and put the local peer last
    otherwise. LOCAL returns the local peer alone. Peers that failed recently come after
    the local peer. ``last_choice`` is ROUND_ROBIN's state: the peer it picked last time.
    """
    if prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(
            f"prompt_tokens and max_new_tokens must be >= 1, got {prompt_tokens}, {max_new_tokens}"
        )
    best_match = max((e.match_tokens for e in estimates), default=0)
    holder_network_s = min(
        (forward_network_s(e.rtt_s, e.extra_s)
         for e in estimates if not e.is_local and e.match_tokens == best_match),
        default=0.0,
    )
    healthy, suspects = candidates_of(
        policy, estimates, prompt_tokens, max_new_tokens, swarm_busy(estimates), best_match,
        holder_network_s,
    )
    return order_candidates(policy, healthy, suspects, rng, last_choice)


def order_candidates(
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
            _prefer_affinity(group)
        elif policy is Policy.LONGEST_PREFIX:
            group.sort(key=_BY_QUEUE)
            group.sort(key=_BY_MATCH, reverse=True)  # reverse keeps equal items in order
        elif policy is Policy.LEAST_LOADED:
            group.sort(key=_BY_QUEUE)
    return healthy + suspects


def _prefer_affinity(by_cost: list[Candidate]) -> None:
    """Among candidates within COST_TIE_FRACTION of the cheapest, move the longest match
    (then the cheapest of those) to the front.

    The fraction is of the cheapest's cost less its decode: the decode is the same for
    peers of one speed, so a tie band that includes it would grow with the answer's
    length and swallow real differences in network, queue and prefill time."""
    if len(by_cost) < 2:
        return
    limit = tie_limit_s(by_cost[0])
    best = 0
    for i in range(1, len(by_cost)):
        c = by_cost[i]
        if c.cost_s > limit:
            break
        if c.match_blocks > by_cost[best].match_blocks:
            best = i
    if best:
        by_cost.insert(0, by_cost.pop(best))


def tie_limit_s(cheapest: Candidate) -> float:
    """The cost up to which a candidate ties with ``cheapest`` (_prefer_affinity): within
    COST_TIE_FRACTION of its cost less its decode."""
    decode = cheapest.estimate.decode_tokens_per_s
    decode_s = cheapest.max_new_tokens / (decode if decode > MIN_TOKENS_PER_S else MIN_TOKENS_PER_S)
    return cheapest.cost_s + COST_TIE_FRACTION * max(0.0, cheapest.cost_s - decode_s)


def swarm_busy(estimates: Sequence[PeerEstimate]) -> float:
    """Mean running requests per candidate: the `busy` of the cost model."""
    return sum(e.running_requests for e in estimates) / len(estimates) if estimates else 0.0


def candidates_of(
    policy: Policy,
    estimates: Sequence[PeerEstimate],
    prompt_tokens: int,
    max_new_tokens: int,
    busy: float,
    best_match_tokens: int,
    holder_network_s: float = 0.0,
) -> tuple[list[Candidate], list[Candidate]]:
    """Candidates with costs, (healthy, failed recently), each ordered local first then by id.

    ``busy`` and ``best_match_tokens`` are over every candidate (swarm_busy, the longest
    match), which may be more than ``estimates``; ``holder_network_s`` is a forward's
    network time to the nearest peer with that match (estimate_cost, local peer only).

    Each cost is estimate_cost's.
    """
    healthy: list[Candidate] = []
    suspects: list[Candidate] = []
    local: Candidate | None = None
    only_local = policy is Policy.LOCAL
    for e in estimates:
        (peer_id, is_local, match_blocks, match_tokens, queued, running, prefill, decode, rtt,
         _, _, _, failed_s_ago, slots, step_tokens, extra_s) = e
        if only_local and not is_local:
            continue
        network_s, queue_s, prefill_s, decode_s = estimate_cost(
            match_tokens, prompt_tokens, max_new_tokens, queued, running, prefill, decode, rtt,
            busy, best_match_tokens, slots, step_tokens, holder_network_s if is_local else 0.0,
            extra_s,
        )
        cost_s = network_s + queue_s + prefill_s + decode_s
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
    e = c.estimate
    cost, charges_s = c.cost_and_charges()
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
    ]
    if charges_s >= 0.0005:  # stated where it shows at the reason's precision
        parts.append(f"{charges_s:.3f} of the prefill the copy and busy charges")
    parts.append(f"load {e.running_requests} running, {e.queued_prompt_tokens} queued tokens")
    if e.batch_slots:
        parts.append(f"batches up to {e.batch_slots} ({e.step_tokens} tokens a step)")
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


def as_measured_here(remote: float, ours: float) -> float:
    """A remote peer's advertised speed as this peer uses it: unknown (<= 0) or within
    SPEED_NOISE_FACTOR of ours counts as ours. Measurement noise then cannot pull every
    request to whichever peer happened to measure itself fastest; a peer that is really
    faster (another CPU class, a GPU) still attracts the work its speed deserves."""
    if remote <= 0 or ours / SPEED_NOISE_FACTOR <= remote <= ours * SPEED_NOISE_FACTOR:
        return ours
    return remote
