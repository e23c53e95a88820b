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

from bench.sim.params import COST_PROBE, ORACLE, RunResult, SimParams
from bench.sim.summaries import IncrementalBloom
from bench.stats import cov, mean, percentile
from bench.workloads import TokenRequest
from peer.config import SUMMARY_EXPIRY_INTERVALS, Policy
from peer.engine.radix import EventKind, RadixCache
from peer.engine.speeds import ewma, prefill_speed_sample, warmup_prefill_speed
from peer.peer_table import ForwardCharge, PeerTable
from peer.probing import (
    DEFAULT_MAX_PROBES,
    DEFAULT_MIN_WAIT_S,
    ProbeRound,
    ProbeSettings,
    plan_probes,
)
from peer.router import Candidate, LocalState, PeerEstimate, Router
from protocols.blocks import BlockHasher
from protocols.bloom import BloomFilter, ProbeCache
from protocols.load import LoadReport
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
        policy = Policy.COST if params.policy in (ORACLE, COST_PROBE) else Policy(params.policy)
        self.router = Router(policy, rng, block_size=params.block_size)
        self.bloom = IncrementalBloom(bloom, memo)
        cal = params.calibration
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
        self.cal = params.calibration
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
        probes = params.load_probes
        if params.policy == COST_PROBE and probes == 0:
            probes = DEFAULT_MAX_PROBES
        elif params.policy not in (Policy.COST.value, COST_PROBE):
            probes = 0
        self._probe_settings = ProbeSettings(
            max_probes=probes,
            max_wait_s=params.load_probe_wait_s,
            min_wait_s=min(DEFAULT_MIN_WAIT_S, params.load_probe_wait_s),
        )
        self._probe_stats = {"rounds": 0, "sent": 0, "answered": 0, "changed": 0, "wait_s": 0.0}

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
        self.jobs.append(job)
        job.entry = self._entry_rng.randrange(self.params.peers)
        entry = self.peers[job.entry]
        wait = 0.0
        if self.params.policy == ORACLE:
            target, match_tokens = self._oracle_choice(entry, job, now)
        elif self._probe_settings.max_probes:
            target, match_tokens, wait = self._probe_choice(entry, job, now)
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
        """COST with load probes, as the live pipeline runs them (peer/probing.py decides
        whom and how long; peer/pipeline.py `_probe`): (target, its match, seconds spent
        waiting for answers). Each probe opens a stream (`stream_setup_rtts` round trips)
        and makes one query round trip; the report is the probed peer's load when the
        entry asked (a few one-way delays early: the simulator decides at arrival)."""
        ranked = self._ranked(entry, job, now)
        plan = plan_probes(ranked, self._probe_settings)
        best = ranked[0]
        if not plan.probes:
            return self._index[best.peer_id], min(best.match_tokens, len(job.tokens) - 1), 0.0
        probe = ProbeRound(plan, now)
        trips = 2 * self.params.stream_setup_rtts + 2  # one-way legs: the stream, the query
        answers = []
        for peer_id in plan.peers:
            at = now + sum(self._one_way() for _ in range(trips))
            peer = self.peers[self._index[peer_id]]
            answers.append((at, peer_id, LoadReport(peer.queued_tokens, peer.running)))
        answers.sort()
        decided = probe.deadline
        for at, peer_id, report in answers:
            probe.offer(peer_id, report, at)
            if probe.done:
                decided = at
                break
        stats = self._probe_stats
        stats["rounds"] += 1
        stats["sent"] += len(plan.peers)
        stats["answered"] += len(probe.reports)
        stats["wait_s"] += decided - now
        chosen = best
        if probe.reports:
            chosen = entry.router.rerank(ranked, probe.reports, entry.table, now)[0]
            stats["changed"] += chosen.peer_id != best.peer_id
        return (
            self._index[chosen.peer_id],
            min(chosen.match_tokens, len(job.tokens) - 1),
            decided - now,
        )

    def _oracle_choice(self, entry: _Peer, job: _Job, now: float) -> tuple[int, int]:
        bs = self.params.block_size
        rtt = 2 * self._d * (1.0 + self.params.jitter / 2)  # the true mean round trip
        # Every simulated peer runs at the same speed, so the oracle prices all of them at
        # the entry peer's measured speeds (the router does the same with speeds within
        # SPEED_NOISE_FACTOR of its own).
        prefill_tps, decode_tps = entry.prefill_tps, entry.decode_tps
        estimates = []
        for peer in self.peers:
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
        prefill = self.cal.prefill_s(job.new, job.cached)
        job.decode_work = self.cal.decode_s(job.req.max_new_tokens - 1)
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
        peer.observe_speeds(job.new, self.cal.prefill_s(job.new, job.cached))
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
            # load probing (all requests, warm-up included): probes sent per request, the
            # fraction of requests whose choice a probe changed, mean wait for answers
            "probes_per_request": self._probe_stats["sent"] / len(jobs),
            "probe_answered_fraction": (
                self._probe_stats["answered"] / self._probe_stats["sent"]
                if self._probe_stats["sent"]
                else 0.0
            ),
            "probe_changed_fraction": self._probe_stats["changed"] / len(jobs),
            "probe_wait_mean_s": self._probe_stats["wait_s"] / len(jobs),
        }
        return RunResult(self.params, metrics, ttft, e2e, [j.target for j in jobs], completions)


def _no_value(_block: int) -> None:
    return None


def simulate(params: SimParams, workload: Sequence[TokenRequest]) -> RunResult:
    """Run one simulation."""
    return Simulator(params, workload).run()
