"""The evaluation's experiments: grids of simulator runs, one result row per run.

Every run's parameters are stated in its row or in the result file's "params". The
offered load is given relative to the swarm's capacity *without* prefix reuse:
`load = 1.0` means arrivals at N / E[cold service time], where the cold service time of
a request is its full prefill plus its decode (Calibration), averaged over the workload.
With reuse the swarm can carry more than load 1.0.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.sim.model import simulate
from bench.sim.params import COST_PROBE, EXACT_LONGEST_PREFIX, ORACLE, SimParams
from bench.sim.regimes import Regime, regime
from bench.workloads import (
    TokenizedMMLU,
    TokenRequest,
    agent_requests,
    chat_requests,
    mmlu_requests,
)
from peer.config import GossipMode, Policy

ALL_POLICIES = (
    Policy.LOCAL.value,
    Policy.RANDOM.value,
    Policy.ROUND_ROBIN.value,
    Policy.LEAST_LOADED.value,
    Policy.LONGEST_PREFIX.value,
    Policy.COST.value,
    ORACLE,
    COST_PROBE,
)
QUICK_POLICIES = (
    Policy.RANDOM.value,
    Policy.LEAST_LOADED.value,
    Policy.LONGEST_PREFIX.value,
    Policy.COST.value,
    ORACLE,
    COST_PROBE,
)
DEPLOYABLE = (
    Policy.LOCAL.value,
    Policy.RANDOM.value,
    Policy.ROUND_ROBIN.value,
    Policy.LEAST_LOADED.value,
    Policy.LONGEST_PREFIX.value,
)  # what `cost` is compared against (the oracle, the what-ifs and the ceiling are not)
PRESSURE_POLICIES = (
    Policy.RANDOM.value,
    Policy.LEAST_LOADED.value,
    Policy.LONGEST_PREFIX.value,
    Policy.COST.value,
    ORACLE,
    EXACT_LONGEST_PREFIX,
)
MULTI_TURN_POLICIES = (Policy.LOCAL.value, *QUICK_POLICIES)
# The quick grid's load sweep: up to where the busiest peer is >= 90% busy under `cost` in
# both regimes (row `busiest_peer_utilization`; tuning seeds: cpu 0.92 at load 2, gpu 0.91
# at 2.5 and 0.94 at 3, runs of QUICK_MIN_RUN_S or more).
QUICK_LOADS = (0.5, 1.0, 1.5, 2.0, 2.5)
QUICK_GPU_LOADS = (*QUICK_LOADS, 3.0)
REQUIRED_ROW_KEYS = (
    "experiment", "policy", "peers", "delay_ms", "zipf_s", "load",
    "ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "hit_ratio", "load_cov",
    "regime", "seed", "workload",
)  # fmt: skip
# The simulator's seed is the workload's plus this: separate random streams (entries,
# delays, routing ties) from the workload's (questions, arrivals).
SIM_SEED_OFFSET = 1000
WORKLOADS = ("mmlu", "chat", "agent")
MULTI_TURN_CAPACITY_BLOCKS = 1024  # 16k tokens a peer for the chat and agent workloads
TURNS_PER_SESSION = 4  # chat_requests' and agent_requests' mean turns (2-6 uniform)
PY_LIBP2P_CPU_S_PER_MESSAGE = 0.007  # docs/libp2p.md: ~7 ms CPU per gossip message received
# The quick grid's MMLU runs last at least this long (ten default summary intervals): a
# run of its 1,200 requests at the gpu regime's top load arrived in 4.3 s, of which the
# warm-up (the first summary interval) left 2.3 s measured while the queues were still
# building; the cpu regime's shortest run lasts 50 s (docs/benchmarks.md, "Run length").
QUICK_MIN_RUN_S = 20.0


@dataclass(frozen=True)
class Base:
    """The base point every sweep varies one or two parameters of."""

    peers: int = 16
    delay_ms: float = 5.0
    zipf_s: float = 1.0
    load: float = 0.5
    requests: int = 3000
    max_new_tokens: int = 8  # the answer letter and a short continuation
    subjects: int | None = None  # None: all 57 MMLU subjects
    seed: int = 1
    min_run_s: float = 0.0  # MMLU runs draw more requests where theirs arrive in less time
    sim: SimParams = field(default_factory=SimParams)
    regime: str = "cpu"  # the regime `sim` is calibrated for


@dataclass(frozen=True)
class Grid:
    """What to run: sweeps (name -> values) and the policies to compare."""

    base: Base
    delays_ms: tuple[float, ...] = (0, 1, 5, 20, 50, 100, 250)
    zipf_s: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5)
    loads: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
    intervals_s: tuple[float, ...] = (0.5, 2.0, 10.0, 30.0)
    bloom_bits: tuple[float, ...] = (4.0, 8.0, 16.0)
    scale_peers: tuple[int, ...] = (16, 64, 256, 1024)
    # scale runs use max(requests, this x peers): 72 x 0.9 (after the warm-up) >= 64 per
    # peer, a steady state
    scale_requests_per_peer: int = 72
    scale_policies: tuple[str, ...] = (Policy.COST.value,)
    scale_gossip_modes: tuple[str, ...] = (GossipMode.FULL.value, GossipMode.RING.value)
    policies: tuple[str, ...] = ALL_POLICIES
    # sweeps b and c: round_robin behaves like random and local like no swarm at all, so
    # the full grid leaves them out there (sweep a keeps every policy)
    skew_load_policies: tuple[str, ...] | None = QUICK_POLICIES
    experiments: tuple[str, ...] = ("delay", "skew", "load", "staleness", "bloom", "scale")
    regimes: tuple[str, ...] = ("cpu",)
    seeds: tuple[int, ...] = ()  # workload seeds; empty: the base's seed only
    # delay sweep points of a regime other than the base's (default: the regime's own)
    delays_by_regime: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # load sweep points of a regime, where they differ from `loads`
    loads_by_regime: tuple[tuple[str, tuple[float, ...]], ...] = ()
    pressures: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)  # x the working set
    pressure_policies: tuple[str, ...] = PRESSURE_POLICIES
    pressure_regimes: tuple[str, ...] = ("cpu", "gpu", "mixed")
    multi_turn_policies: tuple[str, ...] = MULTI_TURN_POLICIES
    multi_turn_delays_ms: tuple[float, ...] = (0.0, 5.0)

    def delays_for(self, name: str) -> tuple[float, ...]:
        """The delay sweep's points in regime `name`."""
        if name == self.base.regime:
            return self.delays_ms
        return dict(self.delays_by_regime).get(name, regime(name).delays_ms)

    def loads_for(self, name: str) -> tuple[float, ...]:
        """The load sweep's points in regime `name`."""
        return dict(self.loads_by_regime).get(name, self.loads)


def _cpu_base(seed: int, requests: int = Base.requests, min_run_s: float = 0.0) -> Base:
    cal = regime("cpu").calibration
    return Base(requests=requests, seed=seed, sim=SimParams(calibration=cal), regime="cpu",
                min_run_s=min_run_s)


def quick_grid(seed: int = 1, seeds: int = 1) -> Grid:
    """Sweeps a, b and c at 16 peers, reduced, in the cpu and gpu regimes: the `--quick`
    run (`seeds` workload seeds from `seed` on)."""
    regimes = ("cpu", "gpu")
    return Grid(
        base=_cpu_base(seed, 1200, QUICK_MIN_RUN_S),
        delays_ms=regime("cpu").quick_delays_ms,
        zipf_s=(0.0, 1.0, 1.5),
        loads=QUICK_LOADS,
        policies=(Policy.LOCAL.value, *QUICK_POLICIES),
        experiments=("delay", "skew", "load"),
        regimes=regimes,
        seeds=tuple(range(seed, seed + seeds)),
        delays_by_regime=tuple((r, regime(r).quick_delays_ms) for r in regimes),
        loads_by_regime=(("gpu", QUICK_GPU_LOADS),),
    )


def full_grid(seed: int = 1, seeds: int = 1) -> Grid:
    """All experiments: the seven sweeps in the cpu regime, and the delay sweep, the cache
    pressure sweep and the chat and agent workloads in every regime."""
    return Grid(base=_cpu_base(seed), seeds=tuple(range(seed, seed + seeds)),
                experiments=("delay", "skew", "load", "staleness", "bloom", "scale",
                             "pressure", "chat", "agent"),
                regimes=("cpu", "gpu", "mixed"))


def final_grid(seed: int = 1, seeds: int = 5) -> Grid:
    """What docs/RESULTS.md is made of besides the quick grid (whose delay sweeps cover
    the cpu and gpu regimes): the delay sweep of the mixed regime, cache pressure in the
    cpu and gpu regimes, chat and agent sessions at d = 5 ms in every regime; 800 requests
    a run (200 sessions), fewer policies than the quick grid (it has to fit next to it)."""
    return Grid(base=_cpu_base(seed, 800), seeds=tuple(range(seed, seed + seeds)),
                delays_ms=(),
                delays_by_regime=(("gpu", ()), ("mixed", regime("mixed").quick_delays_ms)),
                policies=(Policy.LOCAL.value, Policy.RANDOM.value, Policy.LEAST_LOADED.value,
                          Policy.LONGEST_PREFIX.value, Policy.COST.value, ORACLE),
                experiments=("delay", "pressure", "chat", "agent"),
                regimes=("cpu", "gpu", "mixed"), pressure_regimes=("cpu", "gpu"),
                pressure_policies=(Policy.RANDOM.value, Policy.LONGEST_PREFIX.value,
                                   Policy.COST.value, ORACLE, EXACT_LONGEST_PREFIX),
                multi_turn_policies=(Policy.RANDOM.value, Policy.LONGEST_PREFIX.value,
                                     Policy.COST.value, ORACLE, COST_PROBE),
                multi_turn_delays_ms=(5.0,))


def regime_sim(sim: SimParams, reg: Regime) -> SimParams:
    """`sim` with the regime's service times."""
    return dataclasses.replace(sim, calibration=reg.calibration,
                               peer_calibrations=reg.peer_calibrations)


def working_set_blocks(data: TokenizedMMLU, block_size: int) -> int:
    """Full blocks of all subject prefixes: the shared part of the MMLU workload."""
    return sum(len(p) // block_size for p in data.prefixes)


# -- workloads ---------------------------------------------------------------------------


def cold_service_s(requests: Sequence[TokenRequest], sim: SimParams, peer: int = 0) -> float:
    """Mean service time of the requests on peer `peer` with no prefix reuse at all."""
    cal = sim.calibration_of(peer)
    total = 0.0
    for r in requests:
        total += cal.prefill_s(r.prompt_tokens, 0) + cal.decode_s(r.max_new_tokens - 1)
    return total / len(requests)


def arrival_rate(
    requests: Sequence[TokenRequest], sim: SimParams, peers: int, load: float
) -> float:
    """Requests per second for `load` times the swarm's no-reuse capacity (the sum of its
    peers' capacities: they differ in a heterogeneous swarm)."""
    if not sim.peer_calibrations:
        return load * peers / cold_service_s(requests, sim)
    per_cal: dict[int, float] = {}
    capacity = 0.0
    for i in range(peers):
        k = i % len(sim.peer_calibrations)
        if k not in per_cal:
            per_cal[k] = 1.0 / cold_service_s(requests, sim, i)
        capacity += per_cal[k]
    return load * capacity


def make_workload(
    data: TokenizedMMLU, base: Base, peers: int, zipf_s: float, load: float, requests: int,
    *, kind: str = "mmlu", seed: int | None = None, sim: SimParams | None = None,
) -> tuple[list[TokenRequest], float]:
    """The workload at `load`, and its request rate. MMLU arrivals are drawn at rate 1 and
    scaled, so every load sees the same sequence of questions (common random numbers),
    unless `requests` of them arrive in less than `base.min_run_s` at that rate: the run
    then draws as many as arrive in that time (its own sequence). Chat and agent sessions
    keep their think and tool times: their session rate is set from a first draw's
    requests per session and mean service time."""
    seed = base.seed if seed is None else seed
    sim = base.sim if sim is None else sim
    if kind == "mmlu":
        def unit_draw(n: int) -> list[TokenRequest]:
            return mmlu_requests(data, n=n, rate_per_s=1.0, zipf_s=zipf_s,
                                 max_new_tokens=base.max_new_tokens, seed=seed,
                                 subjects=base.subjects)

        unit = unit_draw(requests)
        rate = arrival_rate(unit, sim, peers, load)
        if unit[-1].arrival_s < base.min_run_s * rate:  # at rate 1, arrival times are counts
            unit = unit_draw(math.ceil(base.min_run_s * rate))
            rate = arrival_rate(unit, sim, peers, load)
        scaled = [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in unit]
        return scaled, rate
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; known: {WORKLOADS}")
    sessions = max(1, requests // TURNS_PER_SESSION)

    def draw(session_rate: float) -> list[TokenRequest]:
        if kind == "chat":
            return chat_requests(data, sessions, session_rate, seed=seed)
        return agent_requests(data, sessions, session_rate, seed=seed)

    first = draw(1.0)
    rate = arrival_rate(first, sim, peers, load)
    return draw(rate * sessions / len(first)), rate


# -- runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One run: an experiment label, the point's coordinates and the simulator params."""

    experiment: str
    zipf_s: float
    load: float
    requests: int
    sim: SimParams
    extra: tuple[tuple[str, Any], ...] = ()
    regime: str = "cpu"
    seed: int = 1  # the workload's; the simulator's is in sim.seed
    workload: str = "mmlu"


def specs(grid: Grid, working_set: int | None = None) -> list[RunSpec]:
    """Every run of the grid, in a fixed order: per seed, per regime, per sweep.
    `working_set` (blocks) is needed by the cache-pressure sweep."""
    out: list[RunSpec] = []
    for seed in grid.seeds or (grid.base.seed,):
        for name in grid.regimes:
            _regime_specs(grid, name, seed, working_set, out)
    return out


def _regime_specs(grid: Grid, name: str, seed: int, working_set: int | None,
                  out: list[RunSpec]) -> None:
    b = grid.base
    base_sim = b.sim if name == b.regime else regime_sim(b.sim, regime(name))
    base_sim = dataclasses.replace(base_sim, peers=b.peers, delay_ms=b.delay_ms,
                                   seed=seed + SIM_SEED_OFFSET)

    def at(experiment: str, policy: str, *, zipf_s: float = b.zipf_s, load: float = b.load,
           requests: int = b.requests, extra: Iterable[tuple[str, Any]] = (),
           workload: str = "mmlu", **sim_changes: Any) -> None:
        sim = dataclasses.replace(base_sim, policy=policy, **sim_changes)
        out.append(RunSpec(experiment, zipf_s, load, requests, sim, tuple(extra), name, seed,
                           workload))

    if "delay" in grid.experiments:
        for d in grid.delays_for(name):
            for p in grid.policies:
                at("delay", p, delay_ms=float(d))
    bc_policies = grid.policies if grid.skew_load_policies is None else grid.skew_load_policies
    if "skew" in grid.experiments:
        for s in grid.zipf_s:
            for p in bc_policies:
                at("skew", p, zipf_s=s)
    if "load" in grid.experiments:
        for load in grid.loads_for(name):
            for p in bc_policies:
                at("load", p, load=load)
    adaptive = (Policy.LONGEST_PREFIX.value, Policy.COST.value)
    if "staleness" in grid.experiments:
        for t in grid.intervals_s:
            for p in adaptive:
                for early in (True, False):
                    at("staleness", p, summary_interval_s=t, early_publish=early,
                       extra=[("early_publish", early)])
            for p in (Policy.RANDOM.value, ORACLE):  # references: they ignore summaries
                at("staleness", p, summary_interval_s=t)
    if "bloom" in grid.experiments:
        for bits in grid.bloom_bits:
            for p in adaptive:
                at("bloom", p, bloom_bits_per_entry=bits)
    if "scale" in grid.experiments:
        for n in grid.scale_peers:
            reqs = max(b.requests, grid.scale_requests_per_peer * n)
            for mode in grid.scale_gossip_modes:
                for p in grid.scale_policies:
                    at("scale", p, requests=reqs, peers=n, gossip_mode=mode)
    if "pressure" in grid.experiments and name in grid.pressure_regimes:
        if working_set is None:
            raise ValueError("the pressure sweep needs the workload's working set")
        for x in grid.pressures:
            blocks = max(1, round(x * working_set / b.peers))
            for p in grid.pressure_policies:
                at("pressure", p, capacity_blocks=blocks, extra=[("pressure_x", x)])
    for kind in ("chat", "agent"):
        if kind in grid.experiments:
            for d in grid.multi_turn_delays_ms:
                for p in grid.multi_turn_policies:
                    at(kind, p, workload=kind, delay_ms=float(d),
                       capacity_blocks=MULTI_TURN_CAPACITY_BLOCKS)


_DATA: TokenizedMMLU | None = None  # set before forking workers (copy-on-write)
_GRID_BASE: Base | None = None
_WORKLOADS: dict[tuple[Any, ...], tuple[list[TokenRequest], float]] = {}


def _workload_for(spec: RunSpec) -> tuple[list[TokenRequest], float]:
    assert _DATA is not None and _GRID_BASE is not None
    key = (spec.workload, spec.regime, spec.seed, spec.sim.peers, spec.zipf_s, spec.load,
           spec.requests)
    if key not in _WORKLOADS:
        _WORKLOADS.clear()  # runs come grouped by point: keep one workload in memory
        _WORKLOADS[key] = make_workload(
            _DATA, _GRID_BASE, spec.sim.peers, spec.zipf_s, spec.load, spec.requests,
            kind=spec.workload, seed=spec.seed, sim=spec.sim,
        )
    return _WORKLOADS[key]


def run_spec(spec: RunSpec) -> dict[str, Any]:
    """Run one spec; its result row."""
    workload, rate = _workload_for(spec)
    start = time.perf_counter()
    result = simulate(spec.sim, workload)
    wall = time.perf_counter() - start
    sim = spec.sim
    m = result.metrics
    row: dict[str, Any] = {
        "experiment": spec.experiment,
        "regime": spec.regime,
        "workload": spec.workload,
        "seed": spec.seed,
        "sim_seed": sim.seed,
        "policy": sim.policy,
        "peers": sim.peers,
        "delay_ms": sim.delay_ms,
        "zipf_s": spec.zipf_s,
        "load": spec.load,
        "arrival_rate_per_s": rate,
        "summary_interval_s": sim.summary_interval_s,
        "gossip_mode": sim.gossip_mode,
        "bloom_bits_per_entry": sim.bloom_bits_per_entry,
        "capacity_blocks": sim.capacity_blocks,
        "requests": spec.requests,
        "requests_drawn": len(workload),  # more where the run's minimum length asks for them
        **m,
        "wall_s": wall,
    }
    row["gossip_cpu_fraction_est"] = (
        m["gossip_messages_per_s_per_peer"] * PY_LIBP2P_CPU_S_PER_MESSAGE
    )
    for key, value in spec.extra:
        row[key] = value
    return row


def _init_worker(data: TokenizedMMLU, base: Base) -> None:
    global _DATA, _GRID_BASE
    _DATA = data
    _GRID_BASE = base


def run_grid(
    grid: Grid,
    data: TokenizedMMLU,
    jobs: int = 1,
    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """All runs of the grid, rows in spec order."""
    todo = specs(grid, working_set_blocks(data, grid.base.sim.block_size))
    # A point shared by several sweeps (the base point) is run once and reported in each.
    unique: dict[RunSpec, int] = {}
    for spec in todo:
        unique.setdefault(_unlabelled(spec), len(unique))
    runs = list(unique)
    _init_worker(data, grid.base)
    results: list[dict[str, Any]] = []
    if jobs <= 1:
        for i, spec in enumerate(runs):
            results.append(run_spec(spec))
            if progress:
                progress(i + 1, len(runs), results[-1])
    else:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(jobs, initializer=_init_worker, initargs=(data, grid.base)) as pool:
            for i, row in enumerate(pool.imap(run_spec, runs, chunksize=1)):
                results.append(row)
                if progress:
                    progress(i + 1, len(runs), row)
    rows = []
    for spec in todo:
        row = dict(results[unique[_unlabelled(spec)]])
        row["experiment"] = spec.experiment
        for key, value in spec.extra:
            row[key] = value
        rows.append(row)
    return rows


def _unlabelled(spec: RunSpec) -> RunSpec:
    return dataclasses.replace(spec, experiment="", extra=())
