"""What one simulated run takes (SimParams, with every default's reason) and gives (RunResult)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.sim.calibration import NOTES_CALIBRATION, Calibration
from peer.config import DEFAULT_LOAD_PROBE_WAIT_S, DEFAULT_LOAD_PROBES, Policy
from protocols.bloom import BLOCK_BITS, BloomFilter

ORACLE = "oracle"  # exact, instant global knowledge fed to the COST model (an upper bound)
# COST with load probing on whatever `load_probes` says (DEFAULT_LOAD_PROBES when it is 0).
# `cost` itself probes as the live peer does, with `load_probes` (default: the live
# default); both run peer/probing.py, the live pipeline's core.
COST_PROBE = "cost_probe"
POLICY_NAMES = (*(p.value for p in Policy), ORACLE, COST_PROBE)


@dataclass(frozen=True)
class SimParams:
    """One simulated swarm. Defaults are the base point of every experiment."""

    policy: str = Policy.COST.value
    peers: int = 16
    delay_ms: float = 5.0  # one-way delay between any two peers
    jitter: float = 0.2  # each one-way delay is d * (1 + U(0, jitter))
    stream_setup_rtts: int = 1  # round trips to open a stream before the request is sent
    summary_interval_s: float = 2.0
    early_publish: bool = True  # peer/gossip.py's early publish on 5% change
    bloom_fp_rate: float = 0.01  # the live peer's default (peer/config.py)
    bloom_bits_per_entry: float | None = None  # overrides bloom_fp_rate: bits per capacity block
    capacity_blocks: int = 256  # KV budget per peer: 4,096 tokens, ~190 MB of SmolLM2 fp32 KV
    block_size: int = 16
    cache_generated: bool = False  # the engine's default: generated tokens are not cached
    # RadixCache.evict scans the whole tree per call; when an insert must evict, evict
    # this fraction of the budget beyond the need (a low watermark), so scans are rarer.
    evict_slack_fraction: float = 1 / 16
    # What a forward adds to the target's load in the entry peer's table until the next
    # summary: the whole prompt (False, as peer/pipeline.py does) or only the part the
    # target's Bloom summary does not cover (True; a what-if for the cost model).
    forward_counts_uncached: bool = False
    # Load probes before a forward under `cost` (peer/probing.py; PeerConfig.load_probes
    # and load_probe_wait_s): 0 ranks on gossiped load only, as before probing existed.
    load_probes: int = DEFAULT_LOAD_PROBES
    load_probe_wait_s: float = DEFAULT_LOAD_PROBE_WAIT_S
    warmup_fraction: float = 0.1  # the first requests fill caches; left out of the metrics
    seed: int = 0
    model_id: str = "smollm2-135m"
    calibration: Calibration = field(default_factory=lambda: NOTES_CALIBRATION)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.peers < 1:
            raise ValueError(f"peers must be >= 1, got {self.peers}")
        if self.delay_ms < 0 or self.jitter < 0 or self.stream_setup_rtts < 0:
            raise ValueError("delay_ms, jitter and stream_setup_rtts must be >= 0")
        if self.summary_interval_s <= 0:
            raise ValueError(f"summary_interval_s must be > 0, got {self.summary_interval_s}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if self.bloom_bits_per_entry is not None and self.bloom_bits_per_entry <= 0:
            raise ValueError(f"bloom_bits_per_entry must be > 0, got {self.bloom_bits_per_entry}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["calibration"] = self.calibration.as_dict()
        return out

    def bloom_template(self) -> BloomFilter:
        """An empty filter of the shape every peer publishes."""
        if self.bloom_bits_per_entry is None:
            return BloomFilter.for_capacity(self.capacity_blocks, self.bloom_fp_rate)
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
