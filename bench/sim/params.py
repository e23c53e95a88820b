"""What one simulated run takes (SimParams, with every default's reason) and gives (RunResult)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.sim.calibration import NOTES_CALIBRATION, Calibration
from bench.sim.quota import DEFAULT_PERIOD_S
from peer.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BLOOM_FP_RATE,
    DEFAULT_GOSSIP_NEIGHBOURS,
    DEFAULT_LOAD_PROBE_WAIT_S,
    DEFAULT_LOAD_PROBES,
    DEFAULT_LOOKUP_WAIT_S,
    DEFAULT_MODEL,
    DEFAULT_SUMMARY_INTERVAL_S,
    GossipMode,
    Policy,
)
from peer.engine.scheduler import DEFAULT_MAX_RUNNING, DEFAULT_STEP_TOKENS
from peer.routing.cost import ROUND_TRIPS_PER_FORWARD, STREAM_SETUP_ROUND_TRIPS
from peer.swarm.interest import (
    DEFAULT_INTEREST_PEERS,
    DEFAULT_PROBES_PER_LOOKUP,
    DEFAULT_PROVIDERS_PER_LOOKUP,
)
from peer.swarm.publish_policy import bloom_shape
from protocols.bloom import BLOCK_BITS, BloomFilter

ORACLE = "oracle"  # exact, instant global knowledge fed to the COST model (an upper bound)
# COST with load probing on whatever `load_probes` says (DEFAULT_LOAD_PROBES when it is 0)
# and without the probe's cost budget (peer/routing/probing.py `cost_fraction`): it probes
# whenever a probe could gain its round trips. `cost` itself probes as the live peer does,
# with `load_probes` (default: the live default); both run peer/routing/probing.py.
COST_PROBE = "cost_probe"
# A what-if, not deployable: COST re-ranked (Router.rerank) with every candidate's exact
# load at the moment of the decision, free and instant, as if every peer were probed at no
# cost. The bound on what any fresher-load scheme (probes, piggybacked load, more frequent
# summaries) can give `cost`, with the Bloom matches it has.
COST_EXACT_LOAD = "cost_exact_load"
# A reference, not deployable: every request goes to the peer whose cache holds the longest
# exact prefix of its prompt, known instantly (a tie to the entry peer, then to the least
# busy). The ceiling of the cache-pressure sweep for prefix-affinity routing.
EXACT_LONGEST_PREFIX = "exact_longest_prefix"
# The swarm's trust state at t = 0 (every peer's peer/routing/trust.py ledger, live defaults):
# `established`, every peer has passed every other's probation (a swarm that has run a
# while); `cold`, every peer is new to every other, each on probation.
ESTABLISHED = "established"
COLD = "cold"
SWARM_TRUST_STATES = (ESTABLISHED, COLD)
POLICY_NAMES = (
    *(p.value for p in Policy), ORACLE, COST_PROBE, COST_EXACT_LOAD, EXACT_LONGEST_PREFIX
)


@dataclass(frozen=True)
class SimParams:
    """One simulated swarm. Defaults are the base point of every experiment."""

    policy: str = Policy.COST.value
    peers: int = 16
    delay_ms: float = 5.0  # one-way delay between any two peers
    jitter: float = 0.2  # each one-way delay is d * (1 + U(0, jitter))
    # round trips before a forward's request is sent: the cost model's round trips per
    # forward, less the request's own (0: the negotiation travels with the request)
    forward_setup_rtts: int = ROUND_TRIPS_PER_FORWARD - 1
    # round trips to open any other stream (a probe, a lookup) before it carries a byte
    stream_setup_rtts: int = STREAM_SETUP_ROUND_TRIPS
    summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S
    early_publish: bool = True  # peer/swarm/gossip.py's early publish on 5% change
    gossip_mode: str = GossipMode.FULL.value  # `full` flooding or `ring` neighbourhoods
    gossip_neighbours: int = DEFAULT_GOSSIP_NEIGHBOURS  # ring mode: peers each one hears
    gossip_interest: int = DEFAULT_INTEREST_PEERS  # ring mode: extra peers heard on demand
    lookup_probes: int = DEFAULT_PROBES_PER_LOOKUP  # ring mode: holders asked for a match
    lookup_providers: int = DEFAULT_PROVIDERS_PER_LOOKUP  # ring mode: ... then a summary
    # ring mode: round trips of a lookup at a root's home peer (peer/swarm/lookup.py: a stream's
    # negotiation, then the query), before the holders are asked for their summaries
    lookup_rtts: int = STREAM_SETUP_ROUND_TRIPS + 1
    lookup_wait_s: float = DEFAULT_LOOKUP_WAIT_S  # ring mode: a request waits at most this
    bloom_fp_rate: float = DEFAULT_BLOOM_FP_RATE  # the live peer's default
    bloom_bits_per_entry: float | None = None  # overrides bloom_fp_rate: bits per capacity block
    capacity_blocks: int = 256  # KV budget per peer: 4,096 tokens, ~190 MB of SmolLM2 fp32 KV
    block_size: int = DEFAULT_BLOCK_SIZE
    cache_generated: bool = False  # the engine's default: generated tokens are not cached
    max_running: int = DEFAULT_MAX_RUNNING  # the engine's batch slots (Engine.max_running)
    step_tokens: int = DEFAULT_STEP_TOKENS  # tokens a step computes at most (Engine.step_tokens)
    # What a forward adds to the target's load in the entry peer's table until the next
    # summary: the whole prompt (False, as peer/request/pipeline.py does) or only the part the
    # target's Bloom summary does not cover (True; a what-if for the cost model).
    forward_counts_uncached: bool = False
    # Load probes before a forward under `cost` (peer/routing/probing.py; PeerConfig.load_probes
    # and load_probe_wait_s): 0 ranks on gossiped load only, as before probing existed.
    load_probes: int = DEFAULT_LOAD_PROBES
    load_probe_wait_s: float = DEFAULT_LOAD_PROBE_WAIT_S
    swarm_trust: str = ESTABLISHED  # SWARM_TRUST_STATES
    # The entry re-scores answers as the live pipeline does (peer/request/run.py): a
    # forwarded answer verified before delivery at the ledger's verify_fraction (its
    # client's first token waits for the whole answer and the re-score), and the first
    # answers after promotion audited when the entry is idle, each a prefill at the entry
    # (peer/engine/verify_plan.py). Off: answers cost their entry nothing (the grid's
    # committed rows were made so).
    trust_checks: bool = False
    # the first requests fill caches; left out of the metrics with (at least) those of the
    # first summary interval (Simulator._warmup)
    warmup_fraction: float = 0.1
    seed: int = 0
    model_id: str = DEFAULT_MODEL
    calibration: Calibration = field(default_factory=lambda: NOTES_CALIBRATION)
    # A heterogeneous swarm: peer i serves at peer_calibrations[i % len] (empty: all at
    # `calibration`). Set by a regime (bench/sim/regimes.py).
    peer_calibrations: tuple[Calibration, ...] = ()
    # Peers held to CPU quotas (bench/sim/quota.py): peer i gets cpu_quotas[i % len] of a
    # core per quota_period_s, at a whole core's speed, and its calibration is in CPU
    # seconds of one core. Empty: each peer's calibration is its own time (a fluid server).
    cpu_quotas: tuple[float, ...] = ()
    quota_period_s: float = DEFAULT_PERIOD_S

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.peers < 1:
            raise ValueError(f"peers must be >= 1, got {self.peers}")
        if (self.delay_ms < 0 or self.jitter < 0 or self.stream_setup_rtts < 0
                or self.forward_setup_rtts < 0):
            raise ValueError(
                "delay_ms, jitter, stream_setup_rtts and forward_setup_rtts must be >= 0")
        if self.summary_interval_s <= 0:
            raise ValueError(f"summary_interval_s must be > 0, got {self.summary_interval_s}")
        if self.max_running < 1 or self.step_tokens < 1:
            raise ValueError("max_running and step_tokens must be >= 1")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if self.gossip_mode not in {m.value for m in GossipMode}:
            raise ValueError(f"gossip_mode must be one of {[m.value for m in GossipMode]}")
        if not 2 <= self.gossip_neighbours <= 64 or self.gossip_neighbours % 2:
            raise ValueError(
                f"gossip_neighbours must be even, in [2, 64], got {self.gossip_neighbours}"
            )
        if self.bloom_bits_per_entry is not None and self.bloom_bits_per_entry <= 0:
            raise ValueError(f"bloom_bits_per_entry must be > 0, got {self.bloom_bits_per_entry}")
        if self.swarm_trust not in SWARM_TRUST_STATES:
            raise ValueError(f"swarm_trust must be one of {SWARM_TRUST_STATES}, "
                             f"got {self.swarm_trust!r}")
        if any(not 0 < q <= 1 for q in self.cpu_quotas) or self.quota_period_s <= 0:
            raise ValueError("cpu_quotas must be in (0, 1] of a core, quota_period_s > 0")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["calibration"] = self.calibration.as_dict()
        out["peer_calibrations"] = [c.name for c in self.peer_calibrations]
        return out

    def calibration_of(self, peer: int) -> Calibration:
        """The service times of peer `peer`."""
        if self.peer_calibrations:
            return self.peer_calibrations[peer % len(self.peer_calibrations)]
        return self.calibration

    def bloom_template(self) -> BloomFilter:
        """An empty filter of the shape every peer starts publishing: the live sizing's
        (peer/swarm/publish_policy.py `bloom_shape`, re-applied at each publish), unless
        `bloom_bits_per_entry` fixes the shape."""
        if self.bloom_bits_per_entry is None:
            return BloomFilter(*bloom_shape(0, self.bloom_fp_rate))
        bits = self.bloom_bits_per_entry * self.capacity_blocks
        num_bits = max(1, math.ceil(bits / BLOCK_BITS)) * BLOCK_BITS
        num_hashes = max(1, min(16, round(self.bloom_bits_per_entry * math.log(2))))
        return BloomFilter(num_bits, num_hashes)


@dataclass
class RunResult:
    """Metrics of one run (requests after the warm-up) and per-request samples."""

    params: SimParams
    metrics: dict[str, float]
    ttft_s: list[float]
    e2e_s: list[float]
    served_by: list[int]  # serving peer index per request (all requests)
    completions: list[int]  # times each request completed (conservation check)
