"""Discrete-event simulator of a prefixswarm swarm, and the evaluation's experiments.

    python -m bench.simulate --quick --seeds 5 --json PATH   # a, b, c; cpu and gpu regimes
    python -m bench.simulate --final --seeds 5 --json PATH   # delay, pressure, chat, agent
    python -m bench.simulate --json out/simulate.json --plots docs/results
    python -m bench.claims --run    # both grids, rows under docs/results, docs/RESULTS.md
    python -m bench.simulate --one --policy cost --delay-ms 5 --zipf-s 1 --requests 20000

The simulator (bench/sim/) runs the real pure cores: block hashing, Bloom filters,
summaries, peer table, router and radix cache. Workload: 5-shot MMLU prompts from real
MMLU questions, tokenized with the SmolLM2 tokenizer (token ids cached on disk), subject
popularity Zipf(s), Poisson arrivals. docs/RESULTS.md describes every parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.sim.calibration import Calibration
from bench.sim.checks import compare_cost, held_out, scale_checks
from bench.sim.experiments import (
    WORKLOADS,
    Base,
    Grid,
    final_grid,
    full_grid,
    make_workload,
    quick_grid,
    regime_sim,
    run_grid,
)
from bench.sim.model import simulate
from bench.sim.params import POLICY_NAMES, SWARM_TRUST_STATES, SimParams
from bench.sim.regimes import REGIME_NAMES, regime
from bench.workloads import load_tokenized_mmlu
from peer.config import GossipMode

GOSSIP_MODES = tuple(m.value for m in GossipMode)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="sweeps a, b, c only, reduced grid, cpu and gpu regimes")
    ap.add_argument("--final", action="store_true",
                    help="delay, cache pressure, chat and agent in every regime (reduced)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="workload seeds --seed .. --seed + N - 1 (the simulator's seed of "
                    "each is the workload's + 1000)")
    ap.add_argument("--seed-list", help="comma-separated workload seeds (instead of --seed and "
                    "--seeds), e.g. held-out seeds 101,102,103,104,105")
    ap.add_argument("--swarm-trust", choices=SWARM_TRUST_STATES, default=SimParams.swarm_trust,
                    help="every peer's trust ledger at t = 0: established (each peer past "
                    "every other's probation) or cold (all on probation)")
    ap.add_argument("--regimes", help="comma-separated subset of the grid's regimes: "
                    "cpu,gpu,mixed")
    ap.add_argument("--json", type=Path, help="write {'params', 'rows'} here")
    ap.add_argument("--plots", type=Path, help="write Markdown tables and PNG plots here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: one per CPU; runs are independent and "
                    "seeded, so the rows do not depend on it)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, help="requests per run (default: grid's)")
    ap.add_argument("--experiments", help="comma-separated subset: delay,skew,load,"
                    "staleness,bloom,scale (scale: gossip modes full and ring side by side)")
    ap.add_argument("--policies", help="comma-separated: only these policies, in every sweep")
    ap.add_argument("--scale-requests-per-peer", type=int,
                    help="scale runs use max(--requests, this x peers) requests (default 16)")
    ap.add_argument("--calibration", type=Path,
                    help="a bench/engine --json result to fit service times to "
                    "(default: the notes' SmolLM2 numbers)")
    ap.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                    help="no runs: merge these result files' rows (and params) into --json "
                    "and redraw --plots")
    ap.add_argument("--load-probes", type=int,
                    help="load probes before a forward under cost (peer/routing/probing.py; "
                    "default "
                    "the live peer's); 0: rank on gossiped load only, as before probing")
    ap.add_argument("--one", action="store_true", help="a single run, printed")
    ap.add_argument("--policy", default="cost", choices=POLICY_NAMES)
    ap.add_argument("--regime", default="cpu", choices=REGIME_NAMES)
    ap.add_argument("--workload", default="mmlu", choices=WORKLOADS)
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--load", type=float, default=0.5)
    ap.add_argument("--interval-s", type=float, default=None,
                    help="summary interval, s (default: the live default, 2 s; in a grid, "
                    "a what-if for every run)")
    ap.add_argument("--capacity-blocks", type=int, default=SimParams.capacity_blocks)
    ap.add_argument("--gossip-mode", default=SimParams.gossip_mode, choices=GOSSIP_MODES,
                    help="--one: how summaries travel (full flooding or ring neighbourhoods)")
    ap.add_argument("--neighbours", type=int, default=SimParams.gossip_neighbours,
                    help="--one, ring mode: the peers each one hears")
    ap.add_argument("--lookup-probes", type=int, default=SimParams.lookup_probes,
                    help="--one, ring mode: holders asked how much of a prompt they hold "
                    "per lookup (peer/swarm/interest.py)")
    ap.add_argument("--gossip-modes", help="scale sweep: comma-separated gossip modes "
                    "(default: full,ring)")
    ap.add_argument("--scale-peers", help="scale sweep: comma-separated swarm sizes "
                    "(default: 16,64,256,1024)")
    return ap.parse_args(argv)


def _progress(i: int, n: int, row: dict[str, Any]) -> None:
    print(
        f"[{i}/{n}] {row['experiment']:9s} {row['policy']:14s} N={row['peers']:<3d} "
        f"d={row['delay_ms']:<5g} s={row['zipf_s']:<4g} load={row['load']:<5g} "
        f"ttft={row['ttft_mean_s']:.3f}s e2e={row['e2e_mean_s']:.3f}s "
        f"hit={row['hit_ratio']:.3f} cov={row['load_cov']:.2f} "
        f"busy={row['busiest_peer_utilization']:.2f} ({row['wall_s']:.1f}s)",
        file=sys.stderr,
        flush=True,
    )


def _replot(args: argparse.Namespace) -> int:
    docs = [json.loads(p.read_text()) for p in args.replot]
    rows = [row for doc in docs for row in doc["rows"]]
    params = {**docs[0]["params"], "merged_from": [
        {"file": str(p), "experiments": sorted({r["experiment"] for r in d["rows"]}),
         "wall_s": d["params"].get("wall_s")} for p, d in zip(args.replot, docs, strict=True)]}
    out = {"params": params, "rows": rows, "cost_vs_best": _checks(rows),
           "scale_checks": scale_checks(rows)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    if args.plots:
        _plots(rows, args.plots, params["base"], params["seed"])
    return 0


def _checks(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {f"{p}:{m}": compare_cost(rows, m, ("delay", "skew", "load"), p)
            for p in ("cost", "cost_probe") for m in ("ttft_mean_s", "e2e_mean_s")}


def _plots(rows: list[dict[str, Any]], out_dir: Path, base: dict[str, Any], seed: int) -> None:
    from bench.sim.plots import write_all

    caption = (f"{base['peers']} peers unless varied, d={base['delay_ms']:g} ms, "
               f"s={base['zipf_s']:g}, load={base['load']:g}, {base['requests']} requests/run, "
               f"seed {seed}; see docs/RESULTS.md")
    for path in write_all(rows, out_dir, caption):
        print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.replot:
        return _replot(args)
    cal = (Calibration.from_engine_json(args.calibration) if args.calibration
           else regime("cpu").calibration)
    probes: dict[str, Any] = {} if args.load_probes is None else {"load_probes": args.load_probes}
    probes["swarm_trust"] = args.swarm_trust
    t0 = time.perf_counter()
    data = load_tokenized_mmlu()
    print(f"MMLU tokens ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.one:
        sim = SimParams(policy=args.policy, peers=args.peers, delay_ms=args.delay_ms,
                        summary_interval_s=args.interval_s or SimParams.summary_interval_s,
                        seed=args.seed,
                        capacity_blocks=args.capacity_blocks, calibration=cal,
                        gossip_mode=args.gossip_mode, gossip_neighbours=args.neighbours,
                        lookup_probes=args.lookup_probes, **probes)
        if args.regime != "cpu":
            sim = regime_sim(sim, regime(args.regime))
        base = Base(peers=args.peers, delay_ms=args.delay_ms, zipf_s=args.zipf_s,
                    load=args.load, requests=args.requests or Base.requests, seed=args.seed,
                    sim=sim)
        workload, rate = make_workload(data, base, args.peers, args.zipf_s, args.load,
                                       base.requests, kind=args.workload)
        start = time.perf_counter()
        result = simulate(sim, workload)
        wall = time.perf_counter() - start
        print(json.dumps({"arrival_rate_per_s": rate, "wall_s": wall, **result.metrics},
                         indent=1))
        return 0
    if args.quick:
        grid: Grid = quick_grid(args.seed, args.seeds)
    elif args.final:
        grid = final_grid(args.seed, args.seeds)
    else:
        grid = full_grid(args.seed, args.seeds)
    if args.seed_list:
        grid = dataclasses.replace(grid, seeds=tuple(int(x) for x in args.seed_list.split(",")))
    if args.regimes:
        grid = dataclasses.replace(grid, regimes=tuple(args.regimes.split(",")))
    if args.interval_s is not None:
        probes["summary_interval_s"] = args.interval_s
    base = dataclasses.replace(grid.base, sim=dataclasses.replace(grid.base.sim, calibration=cal,
                                                                  **probes))
    if args.requests:
        base = dataclasses.replace(base, requests=args.requests)
    grid = dataclasses.replace(grid, base=base)
    if args.experiments:
        grid = dataclasses.replace(grid, experiments=tuple(args.experiments.split(",")))
    if args.policies:
        only = tuple(args.policies.split(","))
        unknown = set(only) - set(POLICY_NAMES)
        if unknown:
            raise SystemExit(f"unknown policies {sorted(unknown)}; known: {POLICY_NAMES}")
        grid = dataclasses.replace(grid, policies=only, skew_load_policies=only,
                                   scale_policies=only, pressure_policies=only,
                                   multi_turn_policies=only)
    if args.gossip_modes:
        modes = tuple(args.gossip_modes.split(","))
        if set(modes) - set(GOSSIP_MODES):
            raise SystemExit(f"unknown gossip modes {modes}; known: {GOSSIP_MODES}")
        grid = dataclasses.replace(grid, scale_gossip_modes=modes)
    if args.scale_peers:
        grid = dataclasses.replace(
            grid, scale_peers=tuple(int(n) for n in args.scale_peers.split(","))
        )
    if args.scale_requests_per_peer:
        grid = dataclasses.replace(grid, scale_requests_per_peer=args.scale_requests_per_peer)
    rows = run_grid(grid, data, jobs=args.jobs, progress=_progress)
    wall = time.perf_counter() - t0
    params = {
        "quick": args.quick,
        "final": args.final,
        "seed": args.seed,
        "seeds": list(grid.seeds),
        "regimes": {r: regime(r).calibration.as_dict() | {
            "peer_calibrations": [c.name for c in regime(r).peer_calibrations]}
            for r in grid.regimes},
        "base": {k: v for k, v in dataclasses.asdict(base).items() if k != "sim"},
        "sim": base.sim.as_dict(),
        "grid": {k: v for k, v in dataclasses.asdict(grid).items() if k != "base"},
        "workload": {"kind": "mmlu-5shot; chat and agent sessions (bench/workloads.py)",
                     "tokenizer": data.tokenizer, "subjects": len(data.subjects)},
        "wall_s": wall,
    }
    checks = _checks(rows)
    out = {"params": params, "rows": rows, "cost_vs_best": checks,
           "scale_checks": scale_checks(rows)}
    if len(grid.seeds) > 1:
        out["held_out"] = held_out(rows)
        print(json.dumps({k: out["held_out"][k] for k in ("seeds", "targets", "pass",
                                                          "busy_load")}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    if args.plots:
        _plots(rows, args.plots, params["base"], args.seed)
    worst = {m: max((c["ratio"] for c in cs), default=float("nan")) for m, cs in checks.items()}
    print(f"{len(rows)} runs in {wall:.1f} s; cost / best other, worst point: "
          + ", ".join(f"{m} {w:.3f}" for m, w in worst.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
