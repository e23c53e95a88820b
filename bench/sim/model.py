"""Discrete-event simulation of a prefixswarm swarm that runs the real pure cores.

Each simulated peer owns a real `RadixCache` (LRU eviction, locks), a real `PeerTable`
fed with real `CacheSummary` objects, and a real `Router` (or, for the `oracle` policy,
`rank_estimates` under Policy.COST fed with exact matches and exact loads). Block hashes
come from the real `BlockHasher`, Bloom filters are the real blocked filter (kept
current incrementally, bit-identical to a rebuild: bench/sim/summaries.py).

What is modelled, and how (every number is a field of SimParams or Calibration):
* Server: the engine runs one step at a time and round-robins between its requests
  (one CapacityLimiter, peer/engine/engine.py), modelled as egalitarian processor
  sharing. A request's prefill work is `Calibration.prefill_s(new, cached)`, then
  `decode_s(max_new_tokens - 1)`; the first token comes at the end of prefill. The match
  is taken (and locked) when the request reaches the serving peer; the prompt's blocks
  are inserted when its prefill ends; the lock is released when it completes.
* Load as the engine reports it: queued (uncached) prompt tokens until prefill ends,
  running requests until completion, and prefill/decode speeds measured as the engine
  measures them (peer/engine/speeds.py: prefill chunks of at least two decode steps).
* Network: every one-way message takes d + U(0, jitter * d). A forward first opens a
  stream (multistream-select: `stream_setup_rtts` round trips), then sends the request
  (one way); tokens come back one way. Requests enter at a uniformly chosen peer.
  The entry peer counts a forward on top of its target's last summary until the first
  token, then the end, come back (`PeerTable.record_forward`, `forward_prefilled`,
  `forward_ended`), as peer/pipeline.py does.
* Anti-entropy as in peer/gossip.py: each peer publishes every T seconds and early
  (at most every T/4) once 5% of its cached blocks changed; each summary reaches every
  other peer one one-way delay later (a direct flood; real GossipSub adds mesh hops) and
  is applied with `PeerTable.apply`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from typing import Any

from bench.sim.params import (
    COST_PROBE,
    EXACT_LONGEST_PREFIX,
    ORACLE,
    PROBE_CANDIDATES,
    PROBE_MAX_RTT_FRACTION,
    RunResult,
    SimParams,
)
from bench.sim.summaries import IncrementalBloom
from bench.stats import cov, mean, percentile
from bench.workloads import TokenRequest
from peer.config import SUMMARY_EXPIRY_INTERVALS, Policy
from peer.engine.radix import EventKind, RadixCache
from peer.engine.speeds import ewma, prefill_speed_sample, warmup_prefill_speed
from peer.peer_table import ForwardCharge, PeerTable
from peer.router import Candidate, LocalState, PeerEstimate, Router
from protocols.blocks import BlockHasher
from protocols.bloom import BloomFilter, ProbeCache
from protocols.summary import CacheSummary, encode_summary

# Mirrors of live-peer constants (the modules that hold them import torch or libp2p).
GOSSIP_CHANGE_FRACTION = 0.05  # peer/gossip.py CHANGE_FRACTION
GOSSIP_EARLY_GAP_FRACTION = 0.25  # peer/gossip.py EARLY_GAP_FRACTION
WARMUP_PROMPT_TOKENS = 64  # peer/engine/warmup.py: speeds are seeded by a warm-up run
WARMUP_MAX_PROMPT_TOKENS = 4096  # where the warm-up stops doubling (half a long context)

_EPS = 1e-9  # virtual-time slack for float round-off in the processor-sharing server

# Event kinds, in the order they are handled when simultaneous (then FIFO).
_ARRIVE, _DELIVER, _PHASE, _TICK, _SUMMARY, _FIRST_BACK, _END_BACK = range(7)


class _Job:
    __slots__ = (
        "arrival",
        "cached",
        "chain",
        "charge",
        "decode_work",
        "e2e",
        "entry",
        "history",
        "match",
        "new",
        "req",
        "ret",
        "rid",
        "target",
        "tokens",
        "ttft",
        "vtarget",
    )

    def __init__(self, rid: int, req: TokenRequest, tokens: tuple[int, ...], chain: list[int]):
        self.rid = rid
        self.req = req
        self.tokens = tokens
        self.chain = chain
        self.arrival = req.arrival_s
        self.entry = -1
        self.target = -1
        self.match: Any = None
        self.charge: ForwardCharge | None = None  # the entry's count of it, if forwarded
        self.cached = 0
        self.new = 0
        self.decode_work = 0.0
        self.ret = 0.0
        self.ttft = math.nan
        self.e2e = math.nan
        self.vtarget = 0.0
        self.history = 0  # follow-up turns: tokens of history the engine could have cached


class _Peer:
    """One simulated peer: cache, table, router, a processor-sharing server, gossip state."""

    def __init__(self, idx: int, peer_id: str, params: SimParams, hasher: BlockHasher,
                 rng: random.Random, bloom: BloomFilter, memo: dict[int, tuple[int, int]],
                 probe_cache: ProbeCache) -> None:
        self.idx = idx
        self.peer_id = peer_id
        self.cache: RadixCache[None] = RadixCache(params.block_size, params.capacity_blocks, hasher)
        expiry = SUMMARY_EXPIRY_INTERVALS * params.summary_interval_s
        self.table = PeerTable(peer_id, params.model_id, params.block_size, expiry, probe_cache)
        policy = (Policy(params.policy) if params.policy in {p.value for p in Policy}
                  else Policy.COST)
        self.router = Router(policy, rng, block_size=params.block_size)
        self.bloom = IncrementalBloom(bloom, memo)
        cal = params.calibration_of(idx)
        self.cal = cal
        # Engine.warmup() seeds the speed estimates: decode, then prefill on a prompt
        # long enough to tell.
        self.decode_tps = 1.0 / cal.decode_s_per_token
        self.prefill_tps = warmup_prefill_speed(
            lambda n: cal.prefill_s(n, 0),
            self.decode_tps,
            WARMUP_PROMPT_TOKENS,
            WARMUP_MAX_PROMPT_TOKENS,
        )
        self.queued_tokens = 0
        self.running = 0
        # processor sharing: virtual time advances at 1/n per second with n active jobs
        self.vtime = 0.0
        self.vlast = 0.0
        self.active: list[tuple[float, int, _Job]] = []
        self.version = 0
        self.busy_s = 0.0
        # gossip
        self.seq = 0
        self.last_publish = -math.inf
        self.changed_blocks = 0
        self.published = 0
        self.bytes_published = 0
        self.served = 0
        self.served_after_warmup = 0

    def advance(self, now: float) -> None:
        n = len(self.active)
        if n:
            self.vtime += (now - self.vlast) / n
            self.busy_s += now - self.vlast
        self.vlast = now

    def observe_speeds(self, new: int, prefill_s: float) -> None:
        sample = prefill_speed_sample(new, prefill_s, self.decode_tps)
        if sample is not None:
            self.prefill_tps = ewma(self.prefill_tps, sample)


class Simulator:
    """Runs one SimParams over one workload; `run()` once."""

    def __init__(self, params: SimParams, workload: Sequence[TokenRequest]) -> None:
        if not workload:
            raise ValueError("the workload is empty")
        self.params = params
        self.workload = workload
        self.hasher = BlockHasher(params.model_id, params.block_size)
        # Independent streams: the same seed gives every policy the same entries and delays.
        self._entry_rng = random.Random(f"{params.seed}/entry")
        self._net_rng = random.Random(f"{params.seed}/net")
        self._phase_rng = random.Random(f"{params.seed}/phase")
        route_rng = random.Random(f"{params.seed}/route")
        template = params.bloom_template()
        self.bloom_bits = template.num_bits
        self.bloom_hashes = template.num_hashes
        width = max(3, len(str(params.peers - 1)))
        memo: dict[int, tuple[int, int]] = {}
        probe_cache = ProbeCache()  # one per swarm: every peer probes the same chains
        self.peers = [
            _Peer(i, f"peer{i:0{width}d}", params, self.hasher, route_rng, template, memo,
                  probe_cache)
            for i in range(params.peers)
        ]
        # Summaries delivered so far: the latest per source (delivery time, one-way delay,
        # summary), and per receiver the seq it has applied from each source.
        self._delivered: list[tuple[float, float, CacheSummary] | None] = [None] * params.peers
        self._applied_seq = [[0] * params.peers for _ in range(params.peers)]
        self._index = {p.peer_id: p.idx for p in self.peers}
        self._d = params.delay_ms / 1000.0
        self._events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._prefix_chains: dict[int, list[int]] = {}
        self.jobs: list[_Job] = []
        self._forwarded = 0
        self._summaries_applied = 0
        self._summaries_rejected = 0
        self._now = 0.0
        # Multi-turn workloads: per conversation (group), the prompt length of its last turn.
        self._last_prompt: dict[int, int] = {}

    # -- plumbing ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, a, payload))

    def _one_way(self) -> float:
        d = self._d
        if d <= 0:
            return 0.0
        return d * (1.0 + self._net_rng.random() * self.params.jitter)

    def _chain(self, req: TokenRequest, tokens: tuple[int, ...]) -> list[int]:
        """The block-hash chain; the shared prefix's full blocks are hashed once per key."""
        bs = self.params.block_size
        cached = self._prefix_chains.get(req.prefix_key)
        if cached is None:
            cached = self.hasher.chain(req.prefix)
            self._prefix_chains[req.prefix_key] = cached
        chain = list(cached)
        prev = chain[-1] if chain else None
        for b in range(len(chain), len(tokens) // bs):
            prev = self.hasher.extend(prev, tokens[b * bs : (b + 1) * bs])
            chain.append(prev)
        return chain

    # -- the run ----------------------------------------------------------------------

    def run(self) -> RunResult:
        params = self.params
        for i, req in enumerate(self.workload):
            self._push(req.arrival_s, _ARRIVE, i)
        interval = params.summary_interval_s
        for peer in self.peers:
            self._push(self._phase_rng.random() * interval, _TICK, peer.idx)
        remaining = len(self.workload)
        events = self._events
        while remaining:
            t, kind, _, a, payload = heapq.heappop(events)
            self._now = t
            if kind == _ARRIVE:
                self._arrive(a, t)
            elif kind == _DELIVER:
                self._start(payload, t)
            elif kind == _PHASE:
                remaining -= self._phase(self.peers[a], payload, t)
            elif kind == _TICK:
                self._tick(self.peers[a], t)
            elif kind == _SUMMARY:
                self._deliver_summary(a, payload, t)
            elif kind == _FIRST_BACK:  # the entry's pipeline gives the forward back
                self.peers[a].table.forward_prefilled(payload)
            else:
                self.peers[a].table.forward_ended(payload, prefilled=True)
        return self._result()

    def _arrive(self, rid: int, now: float) -> None:
        req = self.workload[rid]
        tokens = req.prefix + req.suffix
        job = _Job(rid, req, tokens, self._chain(req, tokens))
        if req.turn > 0:
            # the history the engine could have cached: the previous turn's prompt (it does
            # not cache generated tokens unless cache_generated)
            prev = self._last_prompt.get(req.group, 0)
            if self.params.cache_generated:
                prev = max(prev, len(req.prefix))
            bs = self.params.block_size
            job.history = min(prev, len(tokens) - 1) // bs * bs
        self._last_prompt[req.group] = len(tokens)
        self.jobs.append(job)
        job.entry = self._entry_rng.randrange(self.params.peers)
        entry = self.peers[job.entry]
        wait = 0.0
        if self.params.policy == ORACLE:
            target, match_tokens = self._oracle_choice(entry, job, now)
        elif self.params.policy == COST_PROBE:
            target, match_tokens, wait = self._probe_choice(entry, job, now)
        elif self.params.policy == EXACT_LONGEST_PREFIX:
            target, match_tokens = self._exact_choice(entry, job)
        else:
            target, match_tokens = self._router_choice(entry, job, now)
        job.target = target
        if target == job.entry:
            if wait > 0:
                self._push(now + wait, _DELIVER, target, job)
            else:
                self._start(job, now)
            return
        self._forwarded += 1
        counted = len(tokens) - match_tokens if self.params.forward_counts_uncached else len(tokens)
        job.charge = entry.table.record_forward(self.peers[target].peer_id, counted, now)
        delay = sum(self._one_way() for _ in range(2 * self.params.stream_setup_rtts + 1))
        self._push(now + wait + delay, _DELIVER, target, job)

    def _local_state(self, peer: _Peer, tokens: tuple[int, ...]) -> LocalState:
        return LocalState(
            peer.peer_id,
            self._reusable(peer, tokens),
            peer.queued_tokens,
            peer.running,
            peer.prefill_tps,
            peer.decode_tps,
        )

    def _reusable(self, peer: _Peer, tokens: tuple[int, ...]) -> int:
        bs = self.params.block_size
        return min(peer.cache.peek(tokens), (len(tokens) - 1) // bs * bs)

    def _ranked(self, entry: _Peer, job: _Job, now: float) -> list[Candidate]:
        """The entry peer's router, as the live pipeline calls it, on its current table."""
        self._catch_up(entry)
        return entry.router.rank(
            job.chain,
            len(job.tokens),
            job.req.max_new_tokens,
            self._local_state(entry, job.tokens),
            entry.table,
            now,
        )

    def _router_choice(self, entry: _Peer, job: _Job, now: float) -> tuple[int, int]:
        ranked = self._ranked(entry, job, now)
        return self._index[ranked[0].peer_id], min(ranked[0].match_tokens, len(job.tokens) - 1)

    def _probe_choice(self, entry: _Peer, job: _Job, now: float) -> tuple[int, int, float]:
        """COST_PROBE: (target, its match, seconds spent probing)."""
        ranked = self._ranked(entry, job, now)
        remote = [c for c in ranked if not c.is_local][:PROBE_CANDIDATES]
        best = ranked[0]
        if not remote or max(c.estimate.rtt_s for c in remote) > (
            PROBE_MAX_RTT_FRACTION * best.cost_s
        ):
            return self._index[best.peer_id], min(best.match_tokens, len(job.tokens) - 1), 0.0
        local = next(c for c in ranked if c.is_local)
        fresh = [local.estimate]
        for c in remote:
            peer = self.peers[self._index[c.peer_id]]
            fresh.append(c.estimate._replace(
                queued_prompt_tokens=peer.queued_tokens, running_requests=peer.running))
        wait = max(self._one_way() + self._one_way() for _ in remote)
        again = entry.router.rank_estimates(fresh, len(job.tokens), job.req.max_new_tokens)
        chosen = again[0]
        return self._index[chosen.peer_id], min(chosen.match_tokens, len(job.tokens) - 1), wait

    def _exact_choice(self, entry: _Peer, job: _Job) -> tuple[int, int]:
        """EXACT_LONGEST_PREFIX: the longest exact match anywhere, a tie to the entry peer,
        then to the fewest running requests, then to the lowest index."""
        best = max(self.peers, key=lambda p: (self._reusable(p, job.tokens), p is entry,
                                              -p.running, -p.idx))
        return best.idx, self._reusable(best, job.tokens)

    def _oracle_choice(self, entry: _Peer, job: _Job, now: float) -> tuple[int, int]:
        bs = self.params.block_size
        rtt = 2 * self._d * (1.0 + self.params.jitter / 2)  # the true mean round trip
        # Peers of the same calibration are priced at the entry peer's measured speeds (the
        # router does the same with speeds within SPEED_NOISE_FACTOR of its own); others,
        # in a heterogeneous swarm, at their own.
        estimates = []
        for peer in self.peers:
            same = peer.cal is entry.cal
            prefill_tps = entry.prefill_tps if same else peer.prefill_tps
            decode_tps = entry.decode_tps if same else peer.decode_tps
            m = self._reusable(peer, job.tokens)
            local = peer is entry
            estimates.append(
                PeerEstimate(
                    peer.peer_id,
                    local,
                    m // bs,
                    m,
                    peer.queued_tokens,
                    peer.running,
                    prefill_tps,
                    decode_tps,
                    0.0 if local else rtt,
                )
            )
        ranked = entry.router.rank_estimates(estimates, len(job.tokens), job.req.max_new_tokens)
        return self._index[ranked[0].peer_id], ranked[0].match_tokens

    # -- the serving peer: processor sharing --------------------------------------------

    def _start(self, job: _Job, now: float) -> None:
        peer = self.peers[job.target]
        bs = self.params.block_size
        n = len(job.tokens)
        match = peer.cache.match(job.tokens, now, (n - 1) // bs)
        peer.cache.lock(match)
        job.match = match
        job.cached = match.num_tokens
        job.new = n - job.cached
        peer.queued_tokens += job.new
        peer.running += 1
        prefill = peer.cal.prefill_s(job.new, job.cached)
        job.decode_work = peer.cal.decode_s(job.req.max_new_tokens - 1)
        peer.advance(now)
        self._admit(peer, job, prefill, now)

    def _admit(self, peer: _Peer, job: _Job, work: float, now: float) -> None:
        job.vtarget = peer.vtime + work
        heapq.heappush(peer.active, (job.vtarget, job.rid, job))
        self._reschedule(peer, now)

    def _reschedule(self, peer: _Peer, now: float) -> None:
        peer.version += 1
        if peer.active:
            v_next = peer.active[0][0]
            t_next = now + max(0.0, v_next - peer.vtime) * len(peer.active)
            self._push(t_next, _PHASE, peer.idx, peer.version)

    def _phase(self, peer: _Peer, version: int, now: float) -> int:
        """A prefill or decode phase ended on `peer`; returns the requests completed."""
        if version != peer.version:
            return 0
        peer.advance(now)
        done = 0
        while peer.active and peer.active[0][0] <= peer.vtime + _EPS:
            _, _, job = heapq.heappop(peer.active)
            if math.isnan(job.ttft):
                self._prefill_done(peer, job, now)
                if job.decode_work > 0:
                    job.vtarget = peer.vtime + job.decode_work
                    heapq.heappush(peer.active, (job.vtarget, job.rid, job))
                    continue
            self._complete(peer, job, now)
            done += 1
        self._reschedule(peer, now)
        return done

    def _prefill_done(self, peer: _Peer, job: _Job, now: float) -> None:
        peer.queued_tokens -= job.new
        peer.observe_speeds(job.new, peer.cal.prefill_s(job.new, job.cached))
        self._insert(peer, job.tokens, job.cached, now)
        job.ret = 0.0 if job.target == job.entry else self._one_way()
        job.ttft = now + job.ret - job.arrival
        if job.charge is not None:
            self._push(now + job.ret, _FIRST_BACK, job.entry, job.charge)

    def _complete(self, peer: _Peer, job: _Job, now: float) -> None:
        peer.cache.unlock(job.match)
        job.match = None
        if self.params.cache_generated and job.req.output:
            self._insert(peer, job.tokens + job.req.output, len(job.tokens), now)
        peer.running -= 1
        peer.served += 1
        if job.rid >= self._warmup_n:
            peer.served_after_warmup += 1
        job.e2e = now + job.ret - job.arrival
        if job.charge is not None:
            self._push(now + job.ret, _END_BACK, job.entry, job.charge)

    def _insert(self, peer: _Peer, tokens: tuple[int, ...], present: int, now: float) -> None:
        """Insert `tokens`, of which the first `present` are cached and locked."""
        cache = peer.cache
        bs = self.params.block_size
        new_blocks = len(tokens) // bs - present // bs
        need = cache.num_blocks + new_blocks - cache.capacity_blocks
        if need > 0:
            slack = int(cache.capacity_blocks * self.params.evict_slack_fraction)
            cache.evict(need + slack)
        cache.insert(tokens, _no_value, now)
        self._drain(peer)

    def _drain(self, peer: _Peer) -> None:
        events = peer.cache.drain_events()
        for ev in events:
            if ev.kind is EventKind.STORED:
                peer.bloom.add(ev.block_hash)
            else:
                peer.bloom.remove(ev.block_hash)
        peer.changed_blocks += len(events)

    @property
    def _warmup_n(self) -> int:
        return int(len(self.workload) * self.params.warmup_fraction)

    # -- anti-entropy ---------------------------------------------------------------------

    def _tick(self, peer: _Peer, now: float) -> None:
        """One turn of peer/gossip.py's publish loop."""
        interval = self.params.summary_interval_s
        early_gap = interval * GOSSIP_EARLY_GAP_FRACTION
        threshold = max(1, math.ceil(GOSSIP_CHANGE_FRACTION * peer.cache.num_blocks))
        due = now - peer.last_publish >= interval - _EPS
        early = (
            self.params.early_publish
            and peer.changed_blocks >= threshold
            and now - peer.last_publish >= early_gap - _EPS
        )
        if due or early:
            self._publish(peer, now)
        self._push(min(peer.last_publish + interval, now + early_gap), _TICK, peer.idx)

    def _publish(self, peer: _Peer, now: float) -> None:
        peer.seq += 1
        peer.last_publish = now
        peer.changed_blocks = 0
        summary = CacheSummary(
            peer_id=peer.peer_id,
            model_id=self.params.model_id,
            block_size=self.params.block_size,
            seq=peer.seq,
            bloom_bits=peer.bloom.num_bits,
            bloom_hashes=peer.bloom.num_hashes,
            bloom=peer.bloom.to_bytes(),
            cached_blocks=peer.cache.num_blocks,
            capacity_blocks=peer.cache.capacity_blocks,
            queued_prompt_tokens=peer.queued_tokens,
            running_requests=peer.running,
            prefill_tokens_per_s=peer.prefill_tps,
            decode_tokens_per_s=peer.decode_tps,
        )
        peer.published += 1
        peer.bytes_published += len(encode_summary(summary))
        if self.params.peers > 1:
            delay = self._one_way()
            self._push(now + delay, _SUMMARY, peer.idx, (delay, summary))

    def _deliver_summary(self, source: int, item: tuple[float, CacheSummary], now: float) -> None:
        """A summary reaches every other peer now. Applying it is deferred to a receiver's
        next routing decision (`_catch_up`); a newer summary from the same source
        replaces it, which PeerTable.apply would do anyway."""
        delay, summary = item
        latest = self._delivered[source]
        if latest is None or latest[2].seq < summary.seq:
            self._delivered[source] = (now, delay, summary)

    def _catch_up(self, peer: _Peer) -> None:
        """Apply, in delivery order and at their delivery times, the summaries delivered
        to `peer` since it last looked."""
        applied = self._applied_seq[peer.idx]
        todo = []
        for source, latest in enumerate(self._delivered):
            if latest is not None and latest[2].seq > applied[source] and source != peer.idx:
                todo.append((latest[0], source, latest))
        todo.sort()
        table = peer.table
        for t, source, (_, delay, summary) in todo:
            applied[source] = summary.seq
            sender = self.peers[source].peer_id
            result = table.apply(summary, sender, t)
            if result.accepted:
                self._summaries_applied += 1
                table.record_rtt(sender, 2 * delay, t)
            else:
                self._summaries_rejected += 1

    # -- results ----------------------------------------------------------------------

    def _result(self) -> RunResult:
        jobs = sorted(self.jobs, key=lambda j: j.rid)
        completions = [0] * len(self.workload)
        for job in jobs:
            if not math.isnan(job.e2e):
                completions[job.rid] += 1
        kept = [j for j in jobs if j.rid >= self._warmup_n]
        ttft = [j.ttft for j in kept]
        e2e = [j.e2e for j in kept]
        prompt = sum(len(j.tokens) for j in kept)
        reused = sum(j.cached for j in kept)
        served = [p.served_after_warmup for p in self.peers]
        followups = [j for j in kept if j.req.turn > 0]
        history_cached = sum(1 for j in followups if j.cached >= j.history)
        duration = max(self._now, 1e-9)
        n = self.params.peers
        gossip_bytes = sum(p.bytes_published for p in self.peers)
        publishes = sum(p.published for p in self.peers)
        metrics = {
            "requests": float(len(kept)),
            "ttft_mean_s": mean(ttft),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "e2e_mean_s": mean(e2e),
            "e2e_p50_s": percentile(e2e, 0.5),
            "e2e_p99_s": percentile(e2e, 0.99),
            "hit_ratio": reused / prompt if prompt else 0.0,
            "load_cov": cov(served),
            "max_peer_share": max(served) / max(1, sum(served)),
            "forwarded_fraction": self._forwarded / len(jobs),
            "utilization_mean": sum(p.busy_s for p in self.peers) / (n * duration),
            "duration_s": duration,
            "summaries_published": float(publishes),
            "summary_bytes_mean": gossip_bytes / publishes if publishes else 0.0,
            # each summary reaches each of the other n - 1 peers once (a lower bound for
            # GossipSub, which also relays and sends IHAVE gossip)
            "gossip_bytes_per_s_per_peer": gossip_bytes * (n - 1) / n / duration,
            "summaries_rejected": float(self._summaries_rejected),
            "bloom_bits": float(self.bloom_bits),
            "bloom_hashes": float(self.bloom_hashes),
            # multi-turn workloads: follow-up turns served where their history was cached
            # (SMG's metric); nan when the workload has no follow-ups
            "followup_turns": float(len(followups)),
            "followup_cached_fraction": (history_cached / len(followups) if followups
                                         else math.nan),
        }
        return RunResult(self.params, metrics, ttft, e2e, [j.target for j in jobs], completions)


def _no_value(_block: int) -> None:
    return None


def simulate(params: SimParams, workload: Sequence[TokenRequest]) -> RunResult:
    """Run one simulation."""
    return Simulator(params, workload).run()
