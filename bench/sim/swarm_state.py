"""The simulated swarm's state: event kinds, a request in flight, a peer.

A `SimPeer` owns the live peer's pure parts: a real `RadixCache`, `PeerTable`, `Router`,
`TrustLedger` and `ShadowPlanner`, `PublishPolicy` and `CacheFilter`, the ring lookup's
cores, and the speeds the engine measures (seeded as Engine.warmup() seeds them).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

from bench.sim.params import SimParams
from bench.sim.quota import CpuQuota
from bench.workloads import TokenRequest
from peer.config import (
    DEFAULT_PROBATION_REQUESTS,
    DEFAULT_PROBATION_SHARE,
    DEFAULT_VERIFY_FRACTION,
    SUMMARY_EXPIRY_INTERVALS,
    Policy,
)
from peer.engine.radix import RadixCache
from peer.engine.scheduler import BatchQueue
from peer.engine.speeds import (
    WARMUP_PROMPT_TOKENS,
    StepSpeeds,
    warmup_max_prompt_tokens,
    warmup_prefill_speed,
)
from peer.routing.router import Candidate, build_router
from peer.routing.shadow import DEFAULT_MAX_SHADOWS_IN_FLIGHT, Shadow, ShadowPlanner
from peer.routing.trust import TrustLedger
from peer.swarm.incremental_bloom import CacheFilter, Memo, Shape
from peer.swarm.interest import Interest, Lookups
from peer.swarm.peer_table import ForwardCharge, PeerTable
from peer.swarm.providers import RootAnnouncer
from peer.swarm.publish_policy import PublishPolicy
from protocols.blocks import BlockHasher
from protocols.bloom import ProbeCache

# Event kinds, in the order they are handled when simultaneous (then FIFO).
ARRIVE, DELIVER, PHASE, TICK, SUMMARY, FIRST_BACK, END_BACK, VERDICT = range(8)


class Job:
    """One request, or a shadow copy of one (a job at a probation peer that reaches no
    client): its prompt, where it entered and is served, and its progress."""

    __slots__ = (
        "answered",
        "arrival",
        "cached",
        "chain",
        "charge",
        "chosen",
        "decode_left",
        "e2e",
        "entry",
        "first_back",
        "history",
        "lead_s",
        "match",
        "new",
        "pos",
        "probation",
        "queued",
        "req",
        "ret",
        "rid",
        "sent",
        "server_start",
        "server_ttft",
        "shadow",
        "target",
        "tokens",
        "ttft",
        "twin",
        "verify",
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
        self.chosen: Candidate | None = None  # the entry router's first choice (it learns)
        self.cached = 0
        self.new = 0
        self.queued = 0  # what it added to its server's queued prompt tokens
        self.pos = 0  # prompt tokens read (cached ones included)
        self.decode_left = 0  # tokens still to decode after the first
        self.ret = 0.0
        self.sent = math.nan  # forwarded: when the request left the entry on its stream
        self.ttft = math.nan
        self.e2e = math.nan
        self.history = 0  # follow-up turns: tokens of history the engine could have cached
        self.probation: list[Candidate] = []  # the entry router's probation peers, best first
        self.shadow: Shadow | None = None  # set on a shadow copy: the planner's decision
        self.twin: Job | None = None  # a request's shadow copy, a shadow's request
        self.answered = math.nan  # when its whole answer is back at the entry
        self.verify = False  # re-scored at its entry before any of it reaches the client
        self.lead_s = math.nan  # forwarded: the entry's time from routing to sending it
        self.first_back = math.nan  # forwarded: when its first token reached the entry
        self.server_start = math.nan  # when it reached its serving engine
        self.server_ttft = math.nan  # its serving engine's time to its first token


class SimPeer:
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
        # the serving peer's ledger (peer/request/serving.py) at the live defaults; every
        # peer starts on probation, unless the swarm is established (Simulator: trust_all)
        self.trust = TrustLedger(
            verify_fraction=DEFAULT_VERIFY_FRACTION,
            probation_requests=DEFAULT_PROBATION_REQUESTS,
        )
        self.router = build_router(policy, rng, block_size=params.block_size, trust=self.trust)
        # the entry's shadows of requests to peers on probation, as peer/request/pipeline.py
        # builds them
        self.shadows = ShadowPlanner(self.trust, share=DEFAULT_PROBATION_SHARE,
                                     max_in_flight=DEFAULT_MAX_SHADOWS_IN_FLIGHT)
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
        self.queue: BatchQueue[Job] = BatchQueue()  # who waits, who is in the batch
        self.step_started = -1.0  # < 0: no step in flight
        self.overhead_s = 0.0  # CPU owed outside engine steps, paid before the next step
        # the entry's re-scores of answers (SimParams.trust_checks): verified answers whose
        # re-score is owed, then in the step in flight (their clients wait for it); audits
        # waiting for the engine to be idle, CPU seconds each (AUDITS_WAITING at most)
        self.verifying: list[Job] = []
        self.step_verifying: list[Job] = []
        self.audits: list[float] = []  # evidence.py's bounded channel, first in first out
        self.verify_rng = random.Random(f"{params.seed}/verify/{idx}")
        self.step_overhead_s = 0.0  # of the step in flight, the part that was overhead
        self.after_step_s = 0.0  # owed after the step in flight (after_step_fraction)
        self.step_work_s = 0.0  # the step in flight's work (calibration seconds)
        quotas = params.cpu_quotas
        self.quota = (CpuQuota(quotas[idx % len(quotas)], params.quota_period_s) if quotas
                      else None)
        self.busy_s = 0.0
        self.busy_in_window_s = 0.0  # of busy_s, within Simulator.busy_window
        # gossip
        self.seq = 0
        self.published = 0
        self.bytes_published = 0
        self.served = 0  # client requests (shadows are counted apart)
        self.served_after_warmup = 0
        self.shadows_served = 0

    def trust_all(self, peer_ids: Iterable[str]) -> None:
        """An established swarm: each of `peer_ids` has passed this peer's probation, fed to
        the ledger as the pipeline feeds it (matching shadow answers until promoted)."""
        for peer_id in peer_ids:
            while self.trust.on_probation(peer_id):
                self.trust.record_shadow_match(peer_id)

    @property
    def prefill_tps(self) -> float:
        return self.speeds.prefill

    @property
    def decode_tps(self) -> float:
        return self.speeds.decode

    @property
    def batch_decode_tps(self) -> float:
        return self.speeds.batch_decode


def no_value(_block: int) -> None:
    return None
