"""Discrete-event simulation of a prefixswarm swarm that runs the live peer's cores.

Each simulated peer (bench/sim/swarm_state.py) owns a real `RadixCache`, `PeerTable`,
`Router`, `PublishPolicy` and `CacheFilter`; block hashes come from the real
`BlockHasher`. The Simulator is assembled from its sides: the serving engine
(server_model.py), the entry peer's decision (routing_model.py) and anti-entropy
(gossip_model.py); here are the event loop, arrivals and the metrics. Every one-way
message takes d + U(0, jitter * d); a forward first opens a stream (`forward_setup_rtts`
round trips), then sends the request; requests enter at a uniformly chosen peer, which
counts its forwards in flight as peer/request/pipeline.py does, and routes with its own
trust ledger (SimParams.swarm_trust: established or cold at t = 0). Peers on probation
serve no client: as the live entry does, each routed request may carry a shadow copy (the
peer's own ShadowPlanner decides) to the probation peer its router ranks best, a real job
there that reaches no client; its answer (honest peers' greedy answers always match) is
judged when both answers are back at the entry, and DEFAULT_PROBATION_REQUESTS matches
promote. Every number is a field of SimParams or Calibration.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from bench.sim.gossip_model import GossipModel
from bench.sim.params import (
    COST_EXACT_LOAD,
    COST_PROBE,
    ESTABLISHED,
    EXACT_LONGEST_PREFIX,
    ORACLE,
    RunResult,
    SimParams,
)
from bench.sim.routing_model import RoutingModel
from bench.sim.server_model import ServerModel
from bench.sim.swarm_state import (
    ARRIVE,
    DELIVER,
    FIRST_BACK,
    PHASE,
    SUMMARY,
    TICK,
    VERDICT,
    Job,
    SimPeer,
)
from bench.stats import cov, mean, percentile
from bench.workloads import TokenRequest
from peer.config import GossipMode, Policy
from peer.routing.probing import (
    DEFAULT_COST_FRACTION,
    DEFAULT_MAX_PROBES,
    DEFAULT_MIN_WAIT_S,
    ProbeSettings,
)
from peer.routing.shadow import Shadow
from peer.swarm.incremental_bloom import Memo, Shape
from peer.swarm.neighbourhood import Neighbourhood
from peer.swarm.providers import HomeRing, ProviderIndex
from protocols.blocks import BlockHasher
from protocols.bloom import ProbeCache
from protocols.framing import encode_frame
from protocols.roots import SummaryReply
from protocols.summary import CacheSummary

GREEDY = 0.0  # the simulated workload's temperature: answers are compared (shadow.comparable)


class Simulator(ServerModel, RoutingModel, GossipModel):
    """Runs one SimParams over one workload; `run()` once."""

    def __init__(self, params: SimParams, workload: Sequence[TokenRequest],
                 entries: Sequence[int] | None = None) -> None:
        """`entries`: the peer each request enters at (a testbed run's own, replayed);
        None draws them from the seed."""
        if not workload:
            raise ValueError("the workload is empty")
        if entries is not None and (len(entries) != len(workload)
                                    or any(not 0 <= e < params.peers for e in entries)):
            raise ValueError(f"entries must name one of {params.peers} peers per request")
        self._entries = entries
        self.params = params
        self.workload = workload
        self.hasher = BlockHasher(params.model_id, params.block_size)
        # Independent streams: the same seed gives every policy the same entries and delays.
        self._entry_rng = random.Random(f"{params.seed}/entry")
        self._net_rng = random.Random(f"{params.seed}/net")
        self._phase_rng = random.Random(f"{params.seed}/phase")
        self._lookup_rng = random.Random(f"{params.seed}/lookup")
        route_rng = random.Random(f"{params.seed}/route")
        template = params.bloom_template()
        self.bloom_bits = template.num_bits
        self.bloom_hashes = template.num_hashes
        width = max(3, len(str(params.peers - 1)))
        # Filters of one shape share a memo; the live sizing may reshape a peer's filter,
        # unless the bloom sweep fixes the shape.
        memos: dict[Shape, Memo] = {}
        fixed = (None if params.bloom_bits_per_entry is None
                 else (template.num_bits, template.num_hashes))
        probe_cache = ProbeCache()  # one per swarm: every peer probes the same chains
        self.peers = [
            SimPeer(i, f"peer{i:0{width}d}", params, self.hasher, route_rng, fixed, memos,
                    probe_cache, self._lookup_rng)
            for i in range(params.peers)
        ]
        # Summaries delivered so far: the latest per source (delivery time, one-way delay,
        # summary), and per receiver the seq it has applied from each source.
        self._delivered: list[tuple[float, float, CacheSummary] | None] = [None] * params.peers
        self._applied_seq = [[0] * params.peers for _ in range(params.peers)]
        self._index = {p.peer_id: p.idx for p in self.peers}
        if params.swarm_trust == ESTABLISHED:
            for peer in self.peers:
                peer.trust_all(p.peer_id for p in self.peers if p is not peer)
        # ring mode: every peer knows every peer, so all agree on a root's homes
        self._homes = HomeRing()
        self._homes.update(self._index)
        self._home_index: dict[int, ProviderIndex] = {}  # per home peer, made on first use
        self._latest: list[CacheSummary | None] = [None] * params.peers  # last published
        empty_reply = len(encode_frame(SummaryReply(b"").to_wire()))
        self._reply_bytes = [empty_reply] * params.peers  # SummaryReply frame of _latest
        self._lookups = 0
        self._ring = params.gossip_mode == GossipMode.RING.value
        # Per source, the peers that hear its summaries.
        self._audience: list[list[int]] = [[] for _ in self.peers]
        if self._ring:
            ids = [p.peer_id for p in self.peers]
            for peer in self.peers:
                hood = Neighbourhood(peer.peer_id, params.gossip_neighbours)
                hood.update(ids)
                peer.neighbours = frozenset(self._index[m] for m in hood.members)
                for source in peer.neighbours:
                    self._audience[source].append(peer.idx)
        else:
            everyone = list(range(params.peers))
            for peer in self.peers:
                self._audience[peer.idx] = [i for i in everyone if i != peer.idx]
        # Per receiver, the sources whose summaries it may apply: its audience's inverse,
        # less those its full table refused (TABLE_FULL is final here: every peer
        # publishes well within the expiry, so no entry is ever reaped to make room).
        self._sources: list[list[int]] = [
            sorted(p.neighbours) if self._ring else [i for i in range(params.peers) if i != p.idx]
            for p in self.peers
        ]
        self._d = params.delay_ms / 1000.0
        self._events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._prefix_chains: dict[int, list[int]] = {}
        self.jobs: list[Job] = []
        self.shadow_jobs: list[Job] = []  # shadow copies sent, in order
        self.promotions: list[tuple[float, int, int]] = []  # (time, entry, peer promoted)
        self._forwarded = 0
        self.audits_run = 0  # SimParams.trust_checks: audits an idle entry ran, ...
        self.audits_dropped = 0  # ... and those dropped (AUDITS_WAITING were waiting)
        self._summaries_applied = 0
        self._summaries_rejected = 0
        # Called with (peer index, time, summary) at each publish (tests compare it with
        # the live publisher's decisions).
        self.on_publish: Callable[[int, float, CacheSummary], None] | None = None
        self._received = 0  # summaries delivered, counted once per receiver
        self._received_bytes = 0
        self._now = 0.0
        # Multi-turn workloads: per conversation (group), the prompt length of its last turn.
        self._last_prompt: dict[int, int] = {}
        probes = params.load_probes
        if params.policy == COST_PROBE and probes == 0:
            probes = DEFAULT_MAX_PROBES
        elif params.policy not in (Policy.COST.value, COST_PROBE):
            probes = 0
        self._probe_settings = ProbeSettings(
            max_probes=probes,
            max_wait_s=params.load_probe_wait_s,
            min_wait_s=min(DEFAULT_MIN_WAIT_S, params.load_probe_wait_s),
            # cost_probe, the what-if: probe whenever a probe could gain its round trips,
            # whatever share of the request they are (the rule before the cost budget)
            cost_fraction=math.inf if params.policy == COST_PROBE else DEFAULT_COST_FRACTION,
        )
        # the window whose busy time `busiest_peer_utilization` reports: from the first
        # measured arrival (after the warm-up) to the last arrival (before the drain)
        first_id, first_arrival_s = self._warmup
        arrivals = [r.arrival_s for r in workload[first_id:]] or [workload[-1].arrival_s]
        self.busy_window = (max(min(arrivals), first_arrival_s), max(arrivals))
        self._probe_stats = {"rounds": 0, "sent": 0, "answered": 0, "changed": 0, "wait_s": 0.0}

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

    def run(self) -> RunResult:
        params = self.params
        for i, req in enumerate(self.workload):
            self._push(req.arrival_s, ARRIVE, i)
        interval = params.summary_interval_s
        for peer in self.peers:
            self._push(self._phase_rng.random() * interval, TICK, peer.idx)
        remaining = len(self.workload)
        events = self._events
        while remaining:
            t, kind, _, a, payload = heapq.heappop(events)
            self._now = t
            if kind == ARRIVE:
                self._arrive(a, t)
            elif kind == DELIVER:
                self._start(payload, t)
            elif kind == PHASE:
                remaining -= self._phase(self.peers[a], payload, t)
            elif kind == TICK:
                self._tick(self.peers[a], t)
            elif kind == SUMMARY:
                self._deliver_summary(a, payload, t)
            elif kind == FIRST_BACK:  # the entry's pipeline gives the forward back
                self._first_back(self.peers[a], payload, t)
            elif kind == VERDICT:
                self._verdict(self.peers[a], payload, t)
            else:
                remaining -= self._forward_done(self.peers[a], payload, t)
        return self._result()

    def _arrive(self, rid: int, now: float) -> None:
        req = self.workload[rid]
        tokens = req.prefix + req.suffix
        job = Job(rid, req, tokens, self._chain(req, tokens))
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
        job.entry = (self._entries[rid] if self._entries is not None
                     else self._entry_rng.randrange(self.params.peers))
        entry = self.peers[job.entry]
        wait = 0.0
        if (self._ring and job.chain and self.params.policy != ORACLE
                and self.params.lookup_wait_s > 0):
            wait = self._lookup(entry, job, now)
        if self.params.policy == ORACLE:
            target, match_tokens = self._oracle_choice(entry, job, now)
        elif self.params.policy == EXACT_LONGEST_PREFIX:
            target, match_tokens = self._exact_choice(entry, job)
        elif self.params.policy == COST_EXACT_LOAD:
            target, match_tokens = self._exact_load_choice(entry, job, now)
        elif self._probe_settings.max_probes:
            target, match_tokens, probe_wait = self._probe_choice(entry, job, now)
            wait += probe_wait
        else:
            target, match_tokens = self._router_choice(entry, job, now)
        job.target = target
        if self._ring:
            entry.lookups.touch(self.peers[target].peer_id)
        # after routing, as peer/request/pipeline.py asks: a shadow to a probation peer?
        shadow = entry.shadows.choose(job.probation, temperature=GREEDY, private=False)
        if target == job.entry:
            if job.chosen is not None:  # as peer/request/run_context.py `learn_overhead`
                entry.router.forward_overhead.served_here()
            if wait > 0:
                self._push(now + wait, DELIVER, target, job)
            else:
                self._start(job, now)
        else:
            self._forwarded += 1
            if self.params.trust_checks:  # as peer/request/race.py decides it per attempt
                job.verify = entry.trust.should_verify(self.peers[target].peer_id,
                                                       entry.verify_rng)
            self._send(entry, job, match_tokens, now, wait)
        if shadow is not None:
            self._send_shadow(entry, job, shadow, now, wait)

    def _send(self, entry: SimPeer, job: Job, match_tokens: int, now: float,
              wait: float) -> None:
        """Forward ``job`` to ``job.target`` after ``wait``: the entry's table counts it; the
        entry's work on it (`forward_overhead_s`: owed to its CPU, and on the request's
        path at one core's speed); a stream opens (`forward_setup_rtts` round trips), then
        the request goes."""
        n = len(job.tokens)
        counted = n - match_tokens if self.params.forward_counts_uncached else n
        job.charge = entry.table.record_forward(self.peers[job.target].peer_id, counted, now)
        work = entry.cal.forward_overhead_s
        self._owe_cpu(entry, work, now)
        legs = [self._one_way() for _ in range(2 * self.params.forward_setup_rtts + 1)]
        ready = self._runnable(entry, now + wait) - now  # a throttled entry sends later
        job.sent = now + ready + work + sum(legs[:-1])  # the stream is open; the request goes
        job.lead_s = max(0.0, ready - wait) + work + sum(legs[:-1])  # learned at delivery
        self._push(now + ready + work + sum(legs), DELIVER, job.target, job)

    def _send_shadow(self, entry: SimPeer, job: Job, shadow: Shadow, now: float,
                     wait: float) -> None:
        """A copy of ``job`` to the probation peer ``shadow`` names: an ordinary forward
        (peer/request/shadow.py) whose answer reaches no client."""
        copy = Job(len(self.workload) + len(self.shadow_jobs), job.req, job.tokens, job.chain)
        copy.entry = job.entry
        copy.target = self._index[shadow.peer_id]
        copy.shadow = shadow
        copy.twin, job.twin = job, copy
        self.shadow_jobs.append(copy)
        chosen = next(c for c in job.probation if c.peer_id == shadow.peer_id)
        self._send(entry, copy, min(chosen.match_tokens, len(job.tokens) - 1), now, wait)

    @functools.cached_property
    def _warmup(self) -> tuple[int, float]:
        """Requests left out of the metrics: the first `warmup_fraction` of them, and
        those arriving within the first summary interval, while the peers' first
        summaries go out (staggered over that interval, run()): until then routing is
        blind to caches and load, which measures the swarm's start, not its routing.
        Returns (first measured request id, first measured arrival time);
        `warmup_fraction` 0: no warm-up at all."""
        if self.params.warmup_fraction == 0:
            return 0, -math.inf
        return (int(len(self.workload) * self.params.warmup_fraction),
                self.params.summary_interval_s)

    def _measured(self, job: Job) -> bool:
        first_id, first_arrival_s = self._warmup
        return job.rid >= first_id and job.arrival >= first_arrival_s

    def measured_jobs(self) -> list[Job]:
        """The requests the run's metrics count (after the warm-up), in arrival order."""
        return sorted((j for j in self.jobs if self._measured(j)), key=lambda j: j.rid)

    def _result(self) -> RunResult:
        jobs = sorted(self.jobs, key=lambda j: j.rid)
        completions = [0] * len(self.workload)
        for job in jobs:
            if not math.isnan(job.e2e):
                completions[job.rid] += 1
        kept = [j for j in jobs if self._measured(j)]
        # as the client sees them: over the path between it and its entry as well
        path = [self.peers[j.entry].cal.client_path_s for j in kept]
        ttft = [j.ttft + p for j, p in zip(kept, path, strict=True)]
        e2e = [j.e2e + p for j, p in zip(kept, path, strict=True)]
        prompt = sum(len(j.tokens) for j in kept)
        reused = sum(j.cached for j in kept)
        served = [p.served_after_warmup for p in self.peers]
        followups = [j for j in kept if j.req.turn > 0]
        history_cached = sum(1 for j in followups if j.cached >= j.history)
        duration = max(self._now, 1e-9)
        n = self.params.peers
        gossip_bytes = sum(p.bytes_published for p in self.peers)
        publishes = sum(p.published for p in self.peers)
        received, received_bytes = self._received, self._received_bytes
        window = self.busy_window[1] - self.busy_window[0]
        pairs = n * (n - 1)
        trusted = sum(1 for p in self.peers for q in self.peers
                      if p is not q and not p.trust.on_probation(q.peer_id))
        promoted_at = [t for t, _, _ in self.promotions]
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
            # the busiest peer's busy fraction while measured requests arrive
            "busiest_peer_utilization": (
                max(p.busy_in_window_s for p in self.peers) / window if window > 0 else math.nan
            ),
            "duration_s": duration,
            "summaries_published": float(publishes),
            "summary_bytes_mean": gossip_bytes / publishes if publishes else 0.0,
            # summaries received per peer: each reaches each peer of its audience once (a
            # lower bound for GossipSub, which also relays and sends IHAVE gossip)
            "gossip_messages_per_s_per_peer": received / n / duration,
            "gossip_bytes_per_s_per_peer": received_bytes / n / duration,
            "gossip_neighbours_mean": sum(len(a) for a in self._audience) / n,
            "gossip_lookups": float(self._lookups),
            "summaries_rejected": float(self._summaries_rejected),
            "bloom_bits": float(self.bloom_bits),
            "bloom_hashes": float(self.bloom_hashes),
            # multi-turn workloads: follow-up turns served where their history was cached
            # (SMG's metric); nan when the workload has no follow-ups
            "followup_turns": float(len(followups)),
            "followup_cached_fraction": (history_cached / len(followups) if followups
                                         else math.nan),
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
            # shadows (all requests, warm-up included): copies sent per request; at the end,
            # the fraction of (entry, peer) pairs past probation; when pairs were promoted
            "shadows_per_request": len(self.shadow_jobs) / len(jobs),
            "trusted_pair_fraction": trusted / pairs if pairs else 1.0,
            "promotion_p50_s": percentile(promoted_at, 0.5),
            "promotion_max_s": max(promoted_at, default=math.nan),
            # the entries' re-scores (SimParams.trust_checks; all requests, warm-up
            # included): answers verified before delivery, audits run, audits dropped
            "verified_per_request": sum(j.verify for j in jobs) / len(jobs),
            "audits_per_request": self.audits_run / len(jobs),
            "audits_dropped_per_request": self.audits_dropped / len(jobs),
        }
        return RunResult(self.params, metrics, ttft, e2e, [j.target for j in jobs], completions)


def simulate(params: SimParams, workload: Sequence[TokenRequest]) -> RunResult:
    """Run one simulation."""
    return Simulator(params, workload).run()
