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
from bench.sim.params import COST_PROBE, ORACLE, SimParams
from bench.workloads import TokenizedMMLU, TokenRequest, mmlu_requests
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
REQUIRED_ROW_KEYS = (
    "experiment", "policy", "peers", "delay_ms", "zipf_s", "load",
    "ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "hit_ratio", "load_cov",
)  # fmt: skip
PY_LIBP2P_CPU_S_PER_MESSAGE = 0.007  # docs/libp2p.md: ~7 ms CPU per gossip message received


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
    sim: SimParams = field(default_factory=SimParams)


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
    # peer, a steady state (issue 15)
    scale_requests_per_peer: int = 72
    scale_policies: tuple[str, ...] = (Policy.COST.value,)
    scale_gossip_modes: tuple[str, ...] = (GossipMode.FULL.value, GossipMode.RING.value)
    policies: tuple[str, ...] = ALL_POLICIES
    # sweeps b and c: round_robin behaves like random and local like no swarm at all, so
    # the full grid leaves them out there (sweep a keeps every policy)
    skew_load_policies: tuple[str, ...] | None = QUICK_POLICIES
    experiments: tuple[str, ...] = ("delay", "skew", "load", "staleness", "bloom", "scale")


def quick_grid(seed: int = 1) -> Grid:
    """Sweeps a, b and c at 16 peers, reduced: the `--quick` run (< 2 minutes)."""
    return Grid(
        base=Base(requests=1200, seed=seed),
        delays_ms=(0, 5, 50, 250),
        zipf_s=(0.0, 1.0, 1.5),
        loads=(0.5, 1.0, 1.5),
        policies=QUICK_POLICIES,
        experiments=("delay", "skew", "load"),
    )


def full_grid(seed: int = 1) -> Grid:
    """All seven experiments."""
    return Grid(base=Base(seed=seed))


# -- workloads ---------------------------------------------------------------------------


def cold_service_s(requests: Sequence[TokenRequest], sim: SimParams) -> float:
    """Mean service time of the requests with no prefix reuse at all."""
    cal = sim.calibration
    total = 0.0
    for r in requests:
        total += cal.prefill_s(r.prompt_tokens, 0) + cal.decode_s(r.max_new_tokens - 1)
    return total / len(requests)


def arrival_rate(
    requests: Sequence[TokenRequest], sim: SimParams, peers: int, load: float
) -> float:
    """Requests per second for `load` times the swarm's no-reuse capacity."""
    return load * peers / cold_service_s(requests, sim)


def make_workload(
    data: TokenizedMMLU, base: Base, peers: int, zipf_s: float, load: float, requests: int
) -> tuple[list[TokenRequest], float]:
    """The MMLU workload at `load`, and its arrival rate. Arrivals are drawn at rate 1
    and scaled, so every load sees the same sequence of questions (common random numbers)."""
    unit = mmlu_requests(
        data,
        n=requests,
        rate_per_s=1.0,
        zipf_s=zipf_s,
        max_new_tokens=base.max_new_tokens,
        seed=base.seed,
        subjects=base.subjects,
    )
    rate = arrival_rate(unit, base.sim, peers, load)
    scaled = [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in unit]
    return scaled, rate


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


def specs(grid: Grid) -> list[RunSpec]:
    """Every run of the grid, in a fixed order."""
    b = grid.base
    out: list[RunSpec] = []

    def at(experiment: str, policy: str, *, zipf_s: float = b.zipf_s, load: float = b.load,
           requests: int = b.requests, extra: Iterable[tuple[str, Any]] = (),
           **sim_changes: Any) -> None:
        sim = dataclasses.replace(
            b.sim, policy=policy, peers=b.peers, delay_ms=b.delay_ms, seed=b.seed
        )
        sim = dataclasses.replace(sim, **sim_changes)
        out.append(RunSpec(experiment, zipf_s, load, requests, sim, tuple(extra)))

    if "delay" in grid.experiments:
        for d in grid.delays_ms:
            for p in grid.policies:
                at("delay", p, delay_ms=float(d))
    bc_policies = grid.policies if grid.skew_load_policies is None else grid.skew_load_policies
    if "skew" in grid.experiments:
        for s in grid.zipf_s:
            for p in bc_policies:
                at("skew", p, zipf_s=s)
    if "load" in grid.experiments:
        for load in grid.loads:
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
    return out


_DATA: TokenizedMMLU | None = None  # set before forking workers (copy-on-write)
_GRID_BASE: Base | None = None
_WORKLOADS: dict[tuple[int, float, float, int], tuple[list[TokenRequest], float]] = {}


def _workload_for(spec: RunSpec) -> tuple[list[TokenRequest], float]:
    assert _DATA is not None and _GRID_BASE is not None
    key = (spec.sim.peers, spec.zipf_s, spec.load, spec.requests)
    if key not in _WORKLOADS:
        _WORKLOADS.clear()  # runs come grouped by point: keep one workload in memory
        _WORKLOADS[key] = make_workload(
            _DATA, _GRID_BASE, spec.sim.peers, spec.zipf_s, spec.load, spec.requests
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
        "policy": sim.policy,
        "peers": sim.peers,
        "delay_ms": sim.delay_ms,
        "zipf_s": spec.zipf_s,
        "load": spec.load,
        "arrival_rate_per_s": rate,
        "summary_interval_s": sim.summary_interval_s,
        "gossip_mode": sim.gossip_mode,
        "bloom_bits_per_entry": sim.bloom_bits_per_entry,
        "requests": spec.requests,
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
    todo = specs(grid)
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


# -- claims ------------------------------------------------------------------------------


def compare_cost(rows: Sequence[dict[str, Any]], metric: str, experiments: Iterable[str],
                 policy: str = Policy.COST.value) -> list[dict[str, Any]]:
    """Per sweep point: `policy`'s `metric` against the best other deployable policy
    (the oracle and the cost variants excluded)."""
    excluded = (Policy.COST.value, COST_PROBE, ORACLE)
    points: dict[tuple[Any, ...], dict[str, float]] = {}
    for r in rows:
        if r["experiment"] not in experiments:
            continue
        key = (r["experiment"], r["peers"], r["delay_ms"], r["zipf_s"], r["load"])
        points.setdefault(key, {})[r["policy"]] = r[metric]
    out = []
    for key, by_policy in points.items():
        if policy not in by_policy:
            continue
        others = {p: v for p, v in by_policy.items() if p not in excluded}
        if not others:
            continue
        best_policy = min(others, key=lambda p: others[p])
        cost = by_policy[policy]
        best = others[best_policy]
        out.append({
            "policy": policy, "experiment": key[0], "peers": key[1], "delay_ms": key[2],
            "zipf_s": key[3],
            "load": key[4], "metric": metric, "cost": cost, "best_other": best,
            "best_other_policy": best_policy,
            "ratio": cost / best if best > 0 else math.inf,
        })  # fmt: skip
    return out


def scale_checks(rows: Sequence[dict[str, Any]], mode: str = GossipMode.RING.value,
                 policy: str = Policy.COST.value) -> dict[str, Any]:
    """Issue 15's targets from the scale rows: `mode` against full flooding at the largest
    N both ran with the same requests (messages and bytes per peer per second, hit ratio),
    and `mode`'s growth from 64 peers (its longest runs at each size)."""
    by: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in rows:
        if r["experiment"] == "scale" and r["policy"] == policy:
            by[(r["gossip_mode"], r["peers"], r["requests"])] = r
    both = sorted((n, q) for m, n, q in by if m == mode and (GossipMode.FULL.value, n, q) in by)
    if not both:
        return {}
    top, requests = both[-1]
    new, full = by[(mode, top, requests)], by[(GossipMode.FULL.value, top, requests)]
    out: dict[str, Any] = {"mode": mode, "policy": policy, "peers": top, "requests": requests}
    for key in ("gossip_messages_per_s_per_peer", "gossip_bytes_per_s_per_peer", "hit_ratio",
                "ttft_mean_s"):
        out[f"{key}_of_full"] = new[key] / full[key] if full[key] else math.nan
    longest = {}
    for m, n, q in sorted(by):
        if m == mode:
            longest[n] = by[(m, n, q)]
    low, high = (64 if 64 in longest else min(longest)), max(longest)
    for key in ("gossip_messages_per_s_per_peer", "gossip_bytes_per_s_per_peer"):
        base = longest[low][key]
        out[f"{key}_growth_{low}_to_{high}"] = longest[high][key] / base if base else math.nan
    return out


def hit_vs_oracle(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point and policy: hit ratio over the oracle's at the same point."""
    oracle: dict[tuple[Any, ...], float] = {}
    for r in rows:
        if r["policy"] == ORACLE:
            oracle[_point(r)] = r["hit_ratio"]
    out = []
    for r in rows:
        o = oracle.get(_point(r))
        if o is None or r["policy"] == ORACLE:
            continue
        out.append({**{k: r[k] for k in REQUIRED_ROW_KEYS[:6]},
                    "hit_ratio": r["hit_ratio"], "oracle_hit_ratio": o,
                    "of_oracle": r["hit_ratio"] / o if o > 0 else math.nan})
    return out


def _point(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["experiment"], r["peers"], r["delay_ms"], r["zipf_s"], r["load"],
            r["summary_interval_s"], r["bloom_bits_per_entry"])
