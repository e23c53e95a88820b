"""Discrete-event simulation of a prefixswarm swarm that runs the real pure cores.

Each simulated peer owns a real `RadixCache` (LRU eviction, locks), a real `PeerTable`
fed with real `CacheSummary` objects, and a real `Router` (or, for the `oracle` policy,
`rank_estimates` under Policy.COST fed with exact matches and exact loads). Block hashes
come from the real `BlockHasher`, Bloom filters are the real blocked filter, kept current
from the cache's events by the live gossip's own `CacheFilter`
(peer/swarm/incremental_bloom.py, bit-identical to a rebuild).

What is modelled, and how (every number is a field of SimParams or Calibration):
* Server: the batching engine (peer/engine/engine.py), step by step, with its own pure
  parts: between steps up to `max_running` waiting requests join the batch
  (scheduler.admit_count), each matched and locked then (late, as the engine does: an
  earlier prompt's blocks may have arrived); a step decodes every sequence past its
  prompt and reads prefill chunks within `step_tokens` (scheduler.plan_step). A step
  takes `Calibration.step_s(decodes, chunks)`. A prompt's first token comes at the end of
  the step that reads its last chunk, when its blocks are inserted (RadixCache.insert
  evicts exactly what it needs, as in the peer); the lock is released when the request
  completes. Not modelled: the engine holding back a request that shares a prompt still
  being read (`_shares_prefill_in_flight`).
* Load as the engine reports it (Engine.load): queued (uncached) prompt tokens from arrival
  until the prompt is read, running requests (waiting ones included) until completion,
  waiting requests, and speeds measured per step as the engine measures them
  (speeds.observe_step).
* Network: every one-way message takes d + U(0, jitter * d). A forward first opens a
  stream (multistream-select: `stream_setup_rtts` round trips), then sends the request
  (one way); tokens come back one way. Requests enter at a uniformly chosen peer.
  The entry peer counts a forward on top of its target's last summary until the first
  token, then the end, come back (`PeerTable.record_forward`, `forward_prefilled`,
  `forward_ended`), as peer/request/pipeline.py does.
* Anti-entropy by the live peer's own `PublishPolicy` (peer/swarm/publish_policy.py: every T
  seconds, early at most every T/4 once 5% of the cached blocks changed; the filter
  shaped by `CacheFilter`, as peer/swarm/gossip.py does). Gossip mode `full`: each summary
  reaches every other peer one one-way delay later (a direct flood; real GossipSub adds
  mesh hops and IHAVE gossip). Mode `ring`: it reaches only the peers whose
  `Neighbourhood` (peer/swarm/neighbourhood.py, over every peer's id) holds the publisher,
  plus the entry peers that looked up one of its prefix roots, as the live peer does
  (peer/swarm/lookup.py's decisions, from the same cores): at each publish a peer's
  `RootAnnouncer` (peer/swarm/providers.py) tells the home peers of the roots its summary
  covers (`HomeRing`: the 2 nearest on the ring, every peer's id known) what it now
  holds and no longer holds, refreshing each root every ANNOUNCE_REFRESH_S; each home
  keeps a `ProviderIndex`. An entry peer asked for a prompt whose root it does not
  hold, and whose whole chain no peer it hears holds (`Lookups.wanted`,
  peer/swarm/interest.py), asks the root's first home (`lookup_rtts` round trips; none when
  it is its own home), asks `lookup_probes` holders drawn at random from the records
  how much of the chain they hold (`RadixCache.match_hashes`), asks the best
  `lookup_providers` of those that beat what it hears for their summary (a stream and a
  query each, in parallel; the reply is the holder's last published summary), applies
  them and keeps hearing those whose summary shows the root in its bounded `Interest`.
  The request waits, at most `lookup_wait_s` (then it is routed with what arrived).
  Messages are counted as the live peer sends them (a request and its reply, each
  received once), with their frame sizes from protocols/roots.py.
  Received summaries are applied with `PeerTable.apply` (which holds at most MAX_PEERS).
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from bench.sim.params import (
    COST_EXACT_LOAD,
    COST_PROBE,
    EXACT_LONGEST_PREFIX,
    ORACLE,
    RunResult,
    SimParams,
)
from bench.stats import cov, mean, percentile
from bench.workloads import TokenRequest
from peer.config import SUMMARY_EXPIRY_INTERVALS, GossipMode, Policy
from peer.engine.radix import RadixCache
from peer.engine.scheduler import StepPlan, admit_count, plan_step, reusable_blocks, reusable_tokens
from peer.engine.speeds import (
    WARMUP_PROMPT_TOKENS,
    StepSpeeds,
    observe_step,
    warmup_max_prompt_tokens,
    warmup_prefill_speed,
)
from peer.routing.cost import single_stream_decode
from peer.routing.probing import (
    DEFAULT_COST_FRACTION,
    DEFAULT_MAX_PROBES,
    DEFAULT_MIN_WAIT_S,
    ProbeRound,
    ProbeSettings,
    plan_probes,
)
from peer.routing.router import Candidate, LocalState, PeerEstimate, Router
from peer.swarm.incremental_bloom import CacheFilter, Memo, Shape
from peer.swarm.interest import Interest, Lookups
from peer.swarm.neighbourhood import Neighbourhood
from peer.swarm.peer_table import ForwardCharge, PeerTable, Verdict
from peer.swarm.providers import HomeRing, ProviderIndex, RootAnnouncer
from peer.swarm.publish_policy import PublishPolicy
from protocols.blocks import BlockHasher
from protocols.bloom import ProbeCache
from protocols.framing import encode_frame
from protocols.load import LoadReport
from protocols.roots import (
    MAX_MATCH_BLOCKS,
    Ack,
    Announce,
    Find,
    Match,
    Matched,
    Providers,
    SummaryQuery,
    SummaryReply,
)
from protocols.summary import CacheSummary, encode_summary

_SUMMARY_QUERY_BYTES = len(encode_frame(SummaryQuery().to_wire()))
_EPS = 1e-9  # virtual-time slack for float round-off in the step schedule

# Event kinds, in the order they are handled when simultaneous (then FIFO).
_ARRIVE, _DELIVER, _PHASE, _TICK, _SUMMARY, _FIRST_BACK, _END_BACK = range(7)


class _Job:
    __slots__ = (
        "arrival",
        "cached",
        "chain",
        "charge",
        "decode_left",
        "e2e",
        "entry",
        "history",
        "match",
        "new",
        "pos",
        "queued",
        "req",
        "ret",
        "rid",
        "target",
        "tokens",
        "ttft",
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
        self.queued = 0  # what it added to its server's queued prompt tokens
        self.pos = 0  # prompt tokens read (cached ones included)
        self.decode_left = 0  # tokens still to decode after the first
        self.ret = 0.0
        self.ttft = math.nan
        self.e2e = math.nan
        self.history = 0  # follow-up turns: tokens of history the engine could have cached


class _Peer:
    """One simulated peer: cache, table, router, a batching server, gossip state."""

    def __init__(self, idx: int, peer_id: str, params: SimParams, hasher: BlockHasher,
                 rng: random.Random, shape: Shape | None, memos: dict[Shape, Memo],
                 probe_cache: ProbeCache, lookup_rng: random.Random) -> None:
        self.idx = idx
        self.peer_id = peer_id
        self.cache: RadixCache[None] = RadixCache(params.block_size, params.capacity_blocks, hasher)
        expiry = SUMMARY_EXPIRY_INTERVALS * params.summary_interval_s
        self.table = PeerTable(peer_id, params.model_id, params.block_size, expiry, probe_cache)
        policy = (Policy(params.policy) if params.policy in {p.value for p in Policy}
                  else Policy.COST)
        self.router = Router(policy, rng, block_size=params.block_size)
        self.filter = CacheFilter(params.bloom_fp_rate, shape=shape, memos=memos)
        self.publish_policy = PublishPolicy(
            params.summary_interval_s, early_publish=params.early_publish
        )
        self.neighbours: frozenset[int] = frozenset()  # ring mode: whose summaries we hear
        # ring mode: the lookup beyond the ring, entry side and holder side
        self.lookups = Lookups(
            Interest(params.gossip_interest, params.summary_interval_s),
            lookup_rng,
            params.lookup_providers,
            params.lookup_probes,
        )
        self.announcer = RootAnnouncer()
        cal = params.calibration_of(idx)
        self.cal = cal
        # Engine.warmup() seeds the speed estimates: decode (a batch of one), then prefill
        # on a prompt long enough to tell.
        decode_tps = 1.0 / cal.decode_s_per_token
        prefill_tps = warmup_prefill_speed(
            lambda n: cal.prefill_s(n, 0),
            decode_tps,
            WARMUP_PROMPT_TOKENS,
            warmup_max_prompt_tokens(cal.max_context),
        )
        self.speeds = StepSpeeds(prefill_tps, decode_tps, decode_tps)
        self.queued_tokens = 0
        self.running = 0  # requests between arrival and completion, waiting ones included
        self.waiting: deque[_Job] = deque()
        self.batch: dict[int, _Job] = {}  # admitted, in admission order (oldest first)
        self.step_started = -1.0  # < 0: no step in flight
        self.busy_s = 0.0
        # gossip
        self.seq = 0
        self.published = 0
        self.bytes_published = 0
        self.served = 0
        self.served_after_warmup = 0

    @property
    def prefill_tps(self) -> float:
        return self.speeds.prefill

    @property
    def decode_tps(self) -> float:
        return self.speeds.decode

    @property
    def batch_decode_tps(self) -> float:
        return self.speeds.batch_decode


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
            _Peer(i, f"peer{i:0{width}d}", params, self.hasher, route_rng, fixed, memos,
                  probe_cache, self._lookup_rng)
            for i in range(params.peers)
        ]
        # Summaries delivered so far: the latest per source (delivery time, one-way delay,
        # summary), and per receiver the seq it has applied from each source.
        self._delivered: list[tuple[float, float, CacheSummary] | None] = [None] * params.peers
        self._applied_seq = [[0] * params.peers for _ in range(params.peers)]
        self._index = {p.peer_id: p.idx for p in self.peers}
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
        self.jobs: list[_Job] = []
        self._forwarded = 0
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

    def _lookup(self, entry: _Peer, job: _Job, now: float) -> float:
        """Ring mode: look up the prompt's root unless the entry holds it or hears a peer
        that holds the whole prompt; listen to the best holders found from now on.
        Returns the seconds the request waited."""
        bs = self.params.block_size
        local = entry.cache.peek(job.tokens) // bs
        if local:
            return 0.0
        self._catch_up(entry)
        root = job.chain[0]
        rows = entry.table.routing_rows(job.chain, now)
        heard = max((row.match_blocks for row in rows), default=0)
        if not entry.lookups.wanted(root, local, heard, len(job.chain), now):
            return 0.0
        self._lookups += 1
        budget = self.params.lookup_wait_s
        home = self._index[self._homes.homes(root, now)[0]]
        index = self._home_index.get(home)
        found = index.providers(root, now) if index is not None else []
        wait = 0.0
        if home != entry.idx:  # one stream to the home: Find, then Providers
            self._count_exchange(Find(root), Providers(root, tuple(found)))
            wait = self._round_trips(self.params.lookup_rtts)
            if wait >= budget:
                return budget
        hood = [self.peers[i].peer_id for i in entry.neighbours]
        probed = entry.lookups.holders_to_probe(found, {entry.peer_id, *hood})
        if not probed:
            return wait
        # one stream per holder, in parallel: Match, then Matched
        trips = self.params.stream_setup_rtts + 1
        match = Match(tuple(job.chain[:MAX_MATCH_BLOCKS]))
        matches = {}
        latest = wait
        for peer_id in probed:
            at = wait + self._round_trips(trips)
            latest = max(latest, at)
            blocks = self.peers[self._index[peer_id]].cache.match_hashes(match.chain)
            self._count_exchange(match, Matched(blocks))
            if at <= budget:
                matches[peer_id] = blocks
        wait = min(budget, latest)
        chosen = entry.lookups.holders_to_ask(matches, heard)
        if not chosen:
            return wait
        # one stream per holder, in parallel: SummaryQuery, then the last summary it published
        answers = [(wait + self._round_trips(trips), p) for p in chosen]
        applied = self._applied_seq[entry.idx]
        answered = []
        for at, peer_id in answers:
            source = self._index[peer_id]
            summary = self._latest[source]
            self._received += 2
            self._received_bytes += _SUMMARY_QUERY_BYTES + self._reply_bytes[source]
            if at > budget:
                continue  # the request goes on without it
            answered.append(peer_id)
            if summary is not None and entry.table.apply(summary, peer_id, now).accepted:
                applied[source] = summary.seq
                self._summaries_applied += 1
        wait = min(budget, max(at for at, _ in answers))
        change = entry.lookups.admit(
            answered,
            lambda p: entry.table.estimate_match(p, job.chain[:1]) >= 1,
            exclude=hood,
        )
        for peer_id in change.removed:
            source = self._index[peer_id]
            self._audience[source].remove(entry.idx)
            self._sources[entry.idx].remove(source)
            applied[source] = 0
            entry.table.remove(peer_id)
        for peer_id in change.added:
            source = self._index[peer_id]
            self._audience[source].append(entry.idx)
            self._sources[entry.idx].append(source)
        return wait

    def _round_trips(self, n: int) -> float:
        return sum(self._one_way() + self._one_way() for _ in range(n))

    def _count_exchange(self, request: Any, reply: Any) -> None:
        """A request and its reply on one stream (protocols/roots.py), each received once."""
        self._received += 2
        self._received_bytes += len(encode_frame(request.to_wire())) + len(
            encode_frame(reply.to_wire())
        )

    def _announce(self, peer: _Peer, now: float) -> None:
        """Ring mode, at each publish: the holder's RootAnnouncer tells the homes of the
        roots its new summary covers; each home's ProviderIndex records it at once."""
        for msg in peer.announcer.sync(peer.cache.root_hashes(), self._homes, now):
            home = self._index[msg.home]
            index = self._home_index.get(home)
            if index is None:
                index = self._home_index[home] = ProviderIndex()
            for root in msg.drop:
                index.withdraw(root, peer.peer_id)
            kept = sum(index.announce(root, peer.peer_id, now) for root in msg.add)
            if home != peer.idx:
                self._count_exchange(Announce(msg.add, msg.drop), Ack(kept))

    def _local_state(self, peer: _Peer, tokens: tuple[int, ...]) -> LocalState:
        return LocalState(
            peer.peer_id,
            self._reusable(peer, tokens),
            peer.queued_tokens,
            peer.running,
            peer.prefill_tps,
            peer.decode_tps,
            peer.batch_decode_tps,
            self.params.max_running,
            self.params.step_tokens,
        )

    def _reusable(self, peer: _Peer, tokens: tuple[int, ...]) -> int:
        return reusable_tokens(peer.cache.peek(tokens), len(tokens), self.params.block_size)

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

    def _exact_load_choice(self, entry: _Peer, job: _Job, now: float) -> tuple[int, int]:
        """COST_EXACT_LOAD: the router's ranking, re-ranked with every remote candidate's
        true load now (no probe, no wait)."""
        ranked = self._ranked(entry, job, now)
        reports = {}
        for c in ranked:
            if not c.is_local:
                peer = self.peers[self._index[c.peer_id]]
                reports[c.peer_id] = LoadReport(peer.queued_tokens, peer.running)
        if reports:
            ranked = entry.router.rerank(ranked, reports, entry.table, now)
        return self._index[ranked[0].peer_id], min(ranked[0].match_tokens, len(job.tokens) - 1)

    def _probe_choice(self, entry: _Peer, job: _Job, now: float) -> tuple[int, int, float]:
        """COST with load probes, as the live pipeline runs them (peer/routing/probing.py decides
        whom and how long; peer/request/pipeline.py `_probe`): (target, its match, seconds spent
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
        slots, step_tokens = self.params.max_running, self.params.step_tokens
        estimates = []
        for peer in self.peers:
            speeds_of = entry if peer.cal is entry.cal else peer
            prefill_tps = speeds_of.prefill_tps
            decode_tps = single_stream_decode(speeds_of.decode_tps, speeds_of.batch_decode_tps)
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
                    batch_slots=slots,
                    step_tokens=step_tokens,
                )
            )
        ranked = entry.router.rank_estimates(estimates, len(job.tokens), job.req.max_new_tokens)
        return self._index[ranked[0].peer_id], ranked[0].match_tokens

    # -- the serving peer: a batching engine ---------------------------------------------

    def _start(self, job: _Job, now: float) -> None:
        """The request reaches its serving peer: it waits for a batch slot."""
        peer = self.peers[job.target]
        job.queued = len(job.tokens) - self._reusable(peer, job.tokens)
        peer.queued_tokens += job.queued
        peer.running += 1
        peer.waiting.append(job)
        if peer.step_started < 0:
            self._step(peer, now)

    def _step(self, peer: _Peer, now: float) -> None:
        """Admit waiting requests, plan the next step and schedule its end (none if idle)."""
        bs = self.params.block_size
        for _ in range(admit_count(len(peer.waiting), len(peer.batch), self.params.max_running)):
            job = peer.waiting.popleft()
            n = len(job.tokens)
            match = peer.cache.match(job.tokens, now, reusable_blocks(n, bs))
            peer.cache.lock(match)
            job.match = match
            job.cached = job.pos = match.num_tokens
            job.new = n - job.cached
            peer.batch[job.rid] = job
        decoding = []
        prefilling = []
        for rid, job in peer.batch.items():
            left = len(job.tokens) - job.pos
            if left:
                prefilling.append((rid, left))
            else:
                decoding.append(rid)
        if not decoding and not prefilling:
            peer.step_started = -1.0
            return
        plan = plan_step(decoding, prefilling, self.params.step_tokens)
        chunks = [(n, peer.batch[rid].pos) for rid, n in plan.prefill]
        peer.step_started = now
        self._push(now + peer.cal.step_s(len(plan.decode), chunks), _PHASE, peer.idx, plan)

    def _phase(self, peer: _Peer, plan: StepPlan, now: float) -> int:
        """A step ended on `peer`: advance its requests; returns the requests completed."""
        seconds = now - peer.step_started
        peer.busy_s += seconds
        prefill_tokens = sum(n for _, n in plan.prefill)
        peer.speeds, _ = observe_step(peer.speeds, prefill_tokens, len(plan.decode), seconds)
        done = 0
        for rid in plan.decode:
            job = peer.batch[rid]
            job.decode_left -= 1
            if job.decode_left <= 0:
                self._complete(peer, job, now)
                done += 1
        for rid, n in plan.prefill:
            job = peer.batch[rid]
            job.pos += n
            if job.pos == len(job.tokens):
                self._prefill_done(peer, job, now)
                job.decode_left = job.req.max_new_tokens - 1
                if job.decode_left <= 0:
                    self._complete(peer, job, now)
                    done += 1
        self._step(peer, now)
        return done

    def _prefill_done(self, peer: _Peer, job: _Job, now: float) -> None:
        peer.queued_tokens -= job.queued
        self._insert(peer, job.tokens, now)
        job.ret = 0.0 if job.target == job.entry else self._one_way()
        job.ttft = now + job.ret - job.arrival
        if job.charge is not None:
            self._push(now + job.ret, _FIRST_BACK, job.entry, job.charge)

    def _complete(self, peer: _Peer, job: _Job, now: float) -> None:
        peer.cache.unlock(job.match)
        job.match = None
        del peer.batch[job.rid]
        if self.params.cache_generated and job.req.output:
            self._insert(peer, job.tokens + job.req.output, now)
        peer.running -= 1
        peer.served += 1
        if self._measured(job):
            peer.served_after_warmup += 1
        job.e2e = now + job.ret - job.arrival
        if job.charge is not None:
            self._push(now + job.ret, _END_BACK, job.entry, job.charge)

    def _insert(self, peer: _Peer, tokens: tuple[int, ...], now: float) -> None:
        """Insert `tokens`' full blocks as the engine does (evicting exactly what it needs)."""
        peer.cache.insert(tokens, _no_value, now)
        self._drain(peer, now)

    def _drain(self, peer: _Peer, now: float) -> None:
        events = peer.cache.drain_events()
        peer.filter.observe(events)
        peer.publish_policy.observe(events, peer.cache.num_blocks)

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

    def _measured(self, job: _Job) -> bool:
        first_id, first_arrival_s = self._warmup
        return job.rid >= first_id and job.arrival >= first_arrival_s

    # -- anti-entropy ---------------------------------------------------------------------

    def _tick(self, peer: _Peer, now: float) -> None:
        """One turn of peer/swarm/gossip.py's publish loop, decided by the same PublishPolicy."""
        if peer.publish_policy.poll(now) is not None:
            self._publish(peer, now)
        self._push(peer.publish_policy.next_deadline(), _TICK, peer.idx)

    def _publish(self, peer: _Peer, now: float) -> None:
        peer.seq += 1
        bloom = peer.filter.current(peer.cache)
        summary = CacheSummary(
            peer_id=peer.peer_id,
            model_id=self.params.model_id,
            block_size=self.params.block_size,
            seq=peer.seq,
            bloom_bits=bloom.num_bits,
            bloom_hashes=bloom.num_hashes,
            bloom=bloom.to_bytes(),
            cached_blocks=peer.cache.num_blocks,
            capacity_blocks=peer.cache.capacity_blocks,
            queued_prompt_tokens=peer.queued_tokens,
            running_requests=peer.running,
            prefill_tokens_per_s=peer.prefill_tps,
            decode_tokens_per_s=peer.decode_tps,
            waiting_requests=len(peer.waiting),
            batch_slots=self.params.max_running,
            batch_decode_tokens_per_s=peer.batch_decode_tps,
            step_tokens=self.params.step_tokens,
        )
        self._latest[peer.idx] = summary
        if self.on_publish is not None:
            self.on_publish(peer.idx, now, summary)
        data = encode_summary(summary)
        size = len(data)
        if self._ring:
            self._reply_bytes[peer.idx] = len(encode_frame(SummaryReply(data).to_wire()))
            self._announce(peer, now)
        peer.published += 1
        peer.bytes_published += size
        audience = len(self._audience[peer.idx])
        self._received += audience
        self._received_bytes += audience * size
        if audience:
            delay = self._one_way()
            self._push(now + delay, _SUMMARY, peer.idx, (delay, summary))

    def _deliver_summary(self, source: int, item: tuple[float, CacheSummary], now: float) -> None:
        """A summary reaches its audience (every other peer, or the ring neighbours that
        hear `source`) now. Applying it is deferred to a receiver's
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
        delivered = self._delivered
        todo = []
        for source in self._sources[peer.idx]:
            latest = delivered[source]
            if latest is not None and latest[2].seq > applied[source]:
                todo.append((latest[0], source, latest))
        todo.sort()
        table = peer.table
        refused = []
        for t, source, (_, delay, summary) in todo:
            applied[source] = summary.seq
            sender = self.peers[source].peer_id
            result = table.apply(summary, sender, t)
            if result.reason is Verdict.TABLE_FULL:
                refused.append(source)
            if result.accepted:
                self._summaries_applied += 1
                table.record_rtt(sender, 2 * delay, t)
            else:
                self._summaries_rejected += 1
        if refused:
            gone = set(refused)
            self._sources[peer.idx] = [s for s in self._sources[peer.idx] if s not in gone]

    # -- results ----------------------------------------------------------------------

    def _result(self) -> RunResult:
        jobs = sorted(self.jobs, key=lambda j: j.rid)
        completions = [0] * len(self.workload)
        for job in jobs:
            if not math.isnan(job.e2e):
                completions[job.rid] += 1
        kept = [j for j in jobs if self._measured(j)]
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
        received, received_bytes = self._received, self._received_bytes
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
        }
        return RunResult(self.params, metrics, ttft, e2e, [j.target for j in jobs], completions)


def _no_value(_block: int) -> None:
    return None


def simulate(params: SimParams, workload: Sequence[TokenRequest]) -> RunResult:
    """Run one simulation."""
    return Simulator(params, workload).run()
