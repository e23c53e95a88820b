"""`python -m bench.testbed --json PATH [--quick]`: real peers on small machines, measured
next to the simulator's prediction. docs/testbed.md says what a run does and costs."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from bench.random_model import from_spec
from bench.report import emit_json
from bench.testbed.beds import Bed, PeerSettings, open_bed
from bench.testbed.beds import log as _log
from bench.testbed.calibrate import (
    QUICK_EFFORT,
    Effort,
    ForwardCost,
    GossipCost,
    background_cores,
    first_requests,
    measure_forward,
    measure_gossip,
    measure_peers,
    served_extra_cpu,
    with_overheads,
)
from bench.testbed.forward_pilot import forward_pilot
from bench.testbed.loads import (
    PILOT_MAX_S,
    PILOT_SEED_OFFSET,
    QUICK_PILOT_MAX_S,
    Pilot,
    first_pilot_rate,
    measured_rates,
)
from bench.testbed.net import CFS_PERIOD_US, quota_problem
from bench.testbed.predict import (
    FORWARD_PILOT_POLICY,
    SimSetup,
    idle_utilization,
    predict,
    rate_for_utilization,
    testbed_setup,
    with_pilot_factors,
)
from bench.testbed.report import summary
from bench.testbed.runner import RunMeasurement, run_policy, summarise, trace
from bench.testbed.workload import WorkloadSpec, describe, run_workload
from bench.workloads import load_tokenized_mmlu

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("cost", "longest_prefix", "local", "random", "least_loaded")
DEFAULT_SHARES = (0.2, 0.3, 0.4, 0.5)
# A random-weight model whose prefill is most of a request's CPU (bench/random_model.py):
# on tiny-random a forward costs its entry about what serving the request there does, so
# no routing can pay. Its cache holds as many tokens as 2 MB of tiny-random's.
DEFAULT_MODEL = "random-256x2"
DEFAULT_CACHE_BYTES = 8_000_000
# The loads: the arrival rate at which the busiest peer of the swarm that does not route
# (LOAD_POLICY) is this busy, measured by two pilot runs (bench/testbed/loads.py); rows
# carry each run's measured value. `high` aims at 0.95 so that runs land >= 0.9.
LOAD_POLICY = "local"
LOADS = {"half": 0.5, "high": 0.95}
# `warmup`: requests each swarm serves before the measured ones (same generator, same
# seed, unmeasured): a fresh swarm's peers are on probation for one another until three
# shadows each have matched (nine per entry with four peers), so without it a run would
# measure the swarm's first seconds, not a running swarm; the prediction leaves out the
# same requests.
# The warm-up arrives faster, by the ratio of the top load's target to its own (`half`:
# 0.95 / 0.5), then pauses WARMUP_PAUSE_S (bench/testbed/workload.py `paced_warmup`);
# pilots are not paced.
# `effort` and `pilot_max_s`: how much the calibration and the first pilot measure
# (bench/testbed/calibrate.py `Effort`, bench/testbed/loads.py); `forward_pilots`: the
# forward pilot's runs (bench/testbed/forward_pilot.py; one quick run's forwards are too
# few to charge, predict.py FORWARD_MIN_FORWARDS, but it is run and recorded).
FULL = {"delays_ms": (0.0, 20.0, 50.0), "loads": ("half", "high"), "runs": 5, "requests": 200,
        "warmup": 60, "effort": Effort(), "pilot_max_s": PILOT_MAX_S, "forward_pilots": 3}
WARMUP_PAUSE_S = 0.5
QUICK = {"delays_ms": (20.0,), "loads": ("high",), "runs": 1, "requests": 60, "warmup": 60,
         "effort": QUICK_EFFORT, "pilot_max_s": QUICK_PILOT_MAX_S, "forward_pilots": 1}
_STARTED = time.monotonic()


def log(message: str) -> None:
    """A progress line on stderr, with the seconds since the bench started."""
    _log(f"{message} [{time.monotonic() - _STARTED:.0f} s]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.testbed", description=__doc__)
    p.add_argument("--json", required=True, help="write the rows here (rewritten as they come)")
    p.add_argument("--quick", action="store_true",
                   help=f"one point, {QUICK['requests']} requests, one run (~3 minutes)")
    p.add_argument("--shares", default=",".join(f"{s:g}" for s in DEFAULT_SHARES),
                   help="CPU share of each peer (cores)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--delays-ms", help="one-way delays (default: 0,20,50; quick: 20)")
    p.add_argument("--loads", help=f"of {sorted(LOADS)} (default: both; quick: high)")
    p.add_argument("--runs", type=int, help="runs per point (default 5; quick 1)")
    p.add_argument("--requests", type=int, help="per policy run (default 200; quick 60)")
    p.add_argument("--warmup", type=int,
                   help="unmeasured requests before them (default and quick 60)")
    p.add_argument("--seed", type=int, default=0, help="run r uses seed + r")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a model peers load, or random-<hidden>x<layers> built for the run "
                   f"(default {DEFAULT_MODEL}; tiny-random is hidden 64)")
    p.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    p.add_argument("--summary-interval", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--bandwidth-mbit", type=float, default=20.0)
    p.add_argument("--rates", help="arrival rates per load, e.g. half=8,high=15 (default: "
                   "from the calibration)")
    p.add_argument("--calibration-json", help="also write the calibration here")
    p.add_argument("--traces", metavar="DIR",
                   help="also write each run's requests, routes and the routers' reasons "
                   "here, one JSON file a run (bench/testbed/runner.py `trace`)")
    p.add_argument("--peer-log", default=os.devnull, help="peers' stderr goes here")
    p.add_argument("--peer-args", default="",
                   help="more `serve` flags for every peer, for what-ifs (rows record them; "
                   "the testbed's results are at the defaults)")
    p.add_argument("--cfs-period-ms", type=float, default=CFS_PERIOD_US / 1000,
                   help="the CPU groups' CFS period: a share q runs at a core's speed for q x "
                   "period, then waits for the next (default %(default)g, the kernel's)")
    p.add_argument("--no-isolation", action="store_true",
                   help="developers: plain peers on loopback, no namespaces, quotas or delay")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    args.policies = [x for x in args.policies.split(",") if x]
    args.shares = tuple(float(x) for x in args.shares.split(","))
    args.delays_ms = (tuple(float(x) for x in args.delays_ms.split(",")) if args.delays_ms
                      else plan["delays_ms"])
    args.loads = tuple(args.loads.split(",")) if args.loads else plan["loads"]
    args.runs = args.runs or plan["runs"]
    args.requests = args.requests or plan["requests"]
    args.warmup = plan["warmup"] if args.warmup is None else args.warmup
    args.effort, args.pilot_max_s = plan["effort"], plan["pilot_max_s"]
    args.forward_pilots = plan["forward_pilots"]
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    args.cfs_period_us = round(args.cfs_period_ms * 1000)
    if (problem := quota_problem(args.shares, args.cfs_period_us)) is not None:
        p.error(problem)
    if set(args.loads) - set(LOADS) or set(args.policies) - set(POLICIES):
        p.error(f"loads must be of {sorted(LOADS)}, policies of {POLICIES}")
    args.rates = ({k: float(v) for k, v in (x.split("=") for x in args.rates.split(","))}
                  if args.rates else {})
    return args


async def calibrate(bed: Bed, args: argparse.Namespace) -> tuple[
        SimSetup, list[Any], ForwardCost, GossipCost | None]:
    log("calibrating: a swarm of `local` peers")
    import httpx

    async with bed.swarm("local") as swarm:
        urls = [p.http or "" for p in swarm.peers]
        names = [f"testbed-p{i}-{s:g}core" for i, s in enumerate(args.shares)]
        cpus = ([functools.partial(swarm.cpu_seconds, i) for i in range(len(urls))]
                if bed.isolated else None)
        gossip, backgrounds = None, None
        if cpus is not None:
            log("calibrating: each peer's idle CPU, and a cache summary's at its publisher "
                "and its receivers")
            await first_requests(urls, args.model_path)
            gossip = await measure_gossip(urls, args.model_path, entry_of(args.shares), args.seed,
                                          cpus, args.summary_interval,
                                          window_s=args.effort.gossip_window_s)
            backgrounds = background_cores(gossip.idle_rates, args.shares)
            log(f"idle: {', '.join(f'{b:.3f}' for b in backgrounds)} cores; a summary costs "
                f"its publisher {gossip.publish_cpu_s * 1e3:.1f} ms CPU and each receiver "
                f"{gossip.receive_cpu_s * 1e3:.1f} ms ({gossip.publishes} summaries)")
        log("calibrating: each peer measured alone")
        speeds = await measure_peers(urls, args.model_path, names, args.seed, cpus=cpus,
                                     shares=args.shares, effort=args.effort,
                                     backgrounds=backgrounds,
                                     period_s=args.cfs_period_us / 1e6)
        async with httpx.AsyncClient() as client:
            view = (await client.get(f"{urls[0]}/v1/swarm", timeout=10.0)).json()
    capacity = int(view["self"]["capacity_blocks"])
    entry = entry_of(args.shares)
    log(f"calibrating: a forward's CPU at its entry (peer {entry} of a `random` swarm)")
    async with bed.swarm("random") as swarm:
        servers = ({p.peer_id: functools.partial(swarm.cpu_seconds, i)
                    for i, p in enumerate(swarm.peers)} if bed.isolated else None)
        forward = await measure_forward(swarm.peers[entry].http or "", args.model_path,
                                        swarm.peers[entry].peer_id, args.seed,
                                        functools.partial(swarm.cpu_seconds, entry),
                                        requests=args.effort.forward_requests,
                                        servers=servers)
    log(f"a forward costs its entry {forward.forwarded_cpu_s * 1e3:.1f} ms CPU "
        f"({forward.forwarded} of {forward.requests} forwarded; "
        f"{forward.local_cpu_s * 1e3:.1f} ms for those it served)")
    ids = {p.peer_id: i for i, p in enumerate(swarm.peers)}
    log("a lone cold request's TTFT at the client, by the peer that served it (the entry "
        f"is peer {entry}): " + ", ".join(
            f"peer {ids.get(pid, '?')} {t * 1e3:.0f} ms"
            for pid, t in sorted(forward.ttft_by_server_s.items(),
                                 key=lambda kv: ids.get(kv[0], len(ids)))))
    shares = [s if bed.isolated else 1.0 for s in args.shares]
    extras = served_extra_cpu(speeds, shares, [p.peer_id for p in swarm.peers], forward)
    log("a forward costs its server, beyond the same request from its own client: "
        + ", ".join(f"peer {i} {x * 1e3:.1f} ms CPU" for i, x in enumerate(extras)))
    calibrations = tuple(with_overheads(s, share, forward.forwarded_cpu_s, gossip, extra)
                         for s, share, extra in zip(speeds, shares, extras, strict=True))
    for i, c in enumerate(calibrations):
        log(f"peer {i} ({args.shares[i]:g} core): fixed {c.prefill_fixed_s * 1e3:.1f} ms "
            f"(request overhead {c.request_overhead_s * 1e3:.1f} ms before the first "
            f"token and {c.request_tail_s * 1e3:.1f} ms after, forward "
            f"{c.forward_overhead_s * 1e3:.1f} ms, served forward "
            f"{c.served_overhead_s * 1e3:.1f} ms), prefill "
            f"{c.prefill_s_per_token * 1e3:.3f} ms/token, decode "
            f"{c.decode_s_per_token * 1e3:.1f} ms/token; cold 512: "
            f"{c.prefill_s(512, 0) * 1e3:.0f} ms; client path {c.client_path_s * 1e3:.1f} ms")
    setup = testbed_setup(calibrations, [s.background_cores for s in speeds], args.shares,
                          bed.isolated, capacity, args.summary_interval, args.warmup, gossip,
                          quota_period_s=args.cfs_period_us / 1e6)
    return setup, speeds, forward, gossip


async def load_rates(bed: Bed, args: argparse.Namespace, setup: SimSetup, speeds: list[Any],
                     workload_at: Callable[..., list[Any]],
                     ) -> tuple[dict[str, float], list[Pilot], SimSetup]:
    """Each load's arrival rate: given (`--rates`), or measured by two `local` pilots
    started at the simulator's rate for the lowest of LOADS (bench/testbed/loads.py);
    and `setup` with the pilots' CPU factors (predict.py `cpu_factors`), as it is without
    pilots."""
    rates = {load: args.rates[load] for load in args.loads if load in args.rates}
    targets = {load: LOADS[load] for load in args.loads if load not in args.rates}
    if not targets:
        return rates, [], setup
    low = min(LOADS.values())  # the first pilot below saturation, whichever loads are run
    simulated, util = rate_for_utilization(setup, low, workload_at, policy=LOAD_POLICY)
    first = first_pilot_rate(simulated, args.warmup + args.requests, args.pilot_max_s)
    log(f"loads: the simulator puts {LOAD_POLICY}'s busiest peer at {util:.2f} busy at "
        f"{simulated:.2f} requests/s; two {LOAD_POLICY} pilots measure it, the first at "
        f"{first:.2f}/s")
    backgrounds = idle_utilization([s.background_cores for s in speeds], args.shares,
                                   bed.isolated)
    seed = args.seed + PILOT_SEED_OFFSET

    async def pilot(rate: float) -> Pilot:
        measured = await run_policy(bed, LOAD_POLICY, workload_at(rate, seed), args.model_path,
                                    seed, warmup=args.warmup)
        row = summarise(measured)
        log(f"pilot at {rate:.2f} requests/s: peers "
            f"{', '.join(f'{u:.2f}' for u in measured.utilization)} busy, ttft "
            f"{row['ttft_mean_s']:.3f} s")
        return Pilot(rate, tuple(measured.utilization), row["ttft_mean_s"])

    measured_rates_, pilots = await measured_rates(targets, first, backgrounds, pilot)
    for load, rate in measured_rates_.items():
        log(f"load {load}: {rate:.2f} requests/s ({LOAD_POLICY}'s busiest peer "
            f"{targets[load]:.2f} busy on the pilots' curve)")
    setup = with_pilot_factors(setup, [(p.rate_per_s, p.peer_utilization) for p in pilots],
                               backgrounds, lambda rate: workload_at(rate, seed), LOAD_POLICY,
                               args.delays_ms[0], seed)
    log("in the pilots each peer's requests took "
        f"{', '.join(f'{f:.2f}' for f in setup.cpu_factors)}x the CPU measured alone; the "
        "simulator charges that")
    return {**rates, **measured_rates_}, pilots, setup


def events_line(row: dict[str, Any]) -> str:
    """A run's work besides serving, in a few words (its row has every event)."""
    ev = row.get("pipeline_events") or {}
    trusted = row.get("trusted_pair_fraction")
    extra = " ".join("-" if x is None else f"{x * 1e3:.0f}" for x in row.get("forward_extra_s")
                     or [])
    return (f"hedges {ev.get('hedges', 0):g} shadows {ev.get('shadow_sent', 0):g} sent "
            f"{ev.get('shadow_matched', 0):g} matched "
            f"{ev.get('shadow_inconclusive', 0):g} inconclusive audits "
            f"{ev.get('responses_audited', 0):g} trusted "
            f"{'?' if trusted is None else f'{trusted:.2f}'} forward extra ms {extra}")


def code_version() -> str | None:
    """The checkout the run's peers were forked from (`git describe --always --dirty`),
    None outside a git checkout: rows are only comparable at the code they name."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def warmup_pace(load: str) -> float:
    """How much faster than `load`'s own arrivals its warm-up arrives: the ratio of the
    top load's target utilisation to its own (near the top load's pace)."""
    return max(1.0, max(LOADS.values()) / LOADS[load])


def write_trace(folder: str, row: dict[str, Any], measured: RunMeasurement) -> None:
    """One run's traces (runner.py `trace`) next to its row's point, policy and seed."""
    name = f"d{row['delay_ms']:g}_{row['load']}_run{row['run']}_{row['policy']}.json"
    point = {k: row[k] for k in ("policy", "delay_ms", "load", "rate_per_s", "run", "seed")}
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**point, **trace(measured)}) + "\n")


def entry_of(shares: Sequence[float]) -> int:
    """The peer with the largest share: its quota throttles the measured work least."""
    return max(range(len(shares)), key=lambda i: shares[i])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    data = load_tokenized_mmlu()
    result: dict[str, Any] = {"params": {}, "calibration": [], "rows": [], "summary": [],
                              "complete": False}

    def save() -> None:
        result["summary"] = summary(result["rows"])
        result["params"]["elapsed_s"] = round(time.monotonic() - started, 1)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="testbed-") as workdir:
        built = from_spec(args.model, Path(workdir))
        if built is not None:
            log(f"model {args.model}: built at {built}")
        args.model_path = str(built or args.model)  # what the peers load and requests name
        settings = PeerSettings(args.model_path, args.cache_bytes, args.summary_interval,
                                Path(args.peer_log), tuple(shlex.split(args.peer_args)))
        async with open_bed(not args.no_isolation, args.shares, settings,
                            args.bandwidth_mbit * 1e6, Path(workdir),
                            args.cfs_period_us) as bed:
            setup, speeds, forward, gossip = await calibrate(bed, args)
            result["calibration"] = [
                {**s.as_dict(), "calibration": c.as_dict()}
                for s, c in zip(speeds, setup.calibrations, strict=True)]
            result["forward_cost"] = forward.as_dict()
            result["gossip_cost"] = gossip.as_dict() if gossip else None
            if args.calibration_json:
                Path(args.calibration_json).write_text(
                    json.dumps(result["calibration"], indent=2) + "\n")

            def workload_at(rate: float, seed: int = args.seed, pace: float = 1.0
                            ) -> list[Any]:
                spec = WorkloadSpec(args.warmup + args.requests, rate, args.max_new_tokens,
                                    seed)
                return run_workload(data, spec, args.warmup, pace, WARMUP_PAUSE_S)

            bed.set_delay(args.delays_ms[0] / 1000)
            rates, pilots, setup = await load_rates(bed, args, setup, speeds, workload_at)
            result["pilots"] = [p.as_dict() for p in pilots]
            # below saturation whichever loads run: a saturated swarm's CPU says nothing
            pilot_rate = min([*rates.values(), *(p.rate_per_s for p in pilots[:1])])
            seeds = [args.seed + PILOT_SEED_OFFSET + i for i in range(args.forward_pilots)]
            setup, result["forward_pilot"] = await forward_pilot(
                bed, setup, lambda seed: workload_at(pilot_rate, seed), seeds, pilot_rate,
                args.model_path, args.delays_ms[0], args.warmup)
            log(f"forward pilot ({FORWARD_PILOT_POLICY}, {pilot_rate:.2f} requests/s): a "
                f"forward took its entry {setup.forward_cpu_s * 1e3:.1f} ms of CPU beyond "
                "the simulation; the simulator charges that")
            if setup.cpu_factors:
                result["cpu_factors"] = [round(f, 4) for f in setup.cpu_factors]
            result["params"] = {
                "shares": list(args.shares), "model": args.model, "policies": args.policies,
                "delays_ms": list(args.delays_ms), "loads": {k: LOADS[k] for k in args.loads},
                "load_policy": LOAD_POLICY, "rates_per_s": rates,
                "rates_from": "given" if set(args.loads) <= set(args.rates) else "pilots",
                "runs": args.runs, "requests": args.requests,
                "warmup_requests": args.warmup,
                "calibration_effort": dataclasses.asdict(args.effort),
                "pilot_max_s": args.pilot_max_s,
                "warmup_pace": {load: warmup_pace(load) for load in args.loads},
                "warmup_pause_s": WARMUP_PAUSE_S,
                "cache_bytes": args.cache_bytes, "capacity_blocks": setup.capacity_blocks,
                "summary_interval_s": args.summary_interval,
                "max_new_tokens": args.max_new_tokens,
                "bandwidth_mbit": args.bandwidth_mbit, "quick": args.quick,
                "cfs_period_ms": args.cfs_period_us / 1000,
                "isolated": bed.isolated, "seed": args.seed, "peer_args": args.peer_args,
                "workload": describe(workload_at(rates[args.loads[0]])),
                "code": code_version(),
            }
            for delay_ms in args.delays_ms:
                bed.set_delay(delay_ms / 1000)
                for load in args.loads:
                    for run in range(args.runs):
                        seed = args.seed + run
                        workload = workload_at(rates[load], seed, warmup_pace(load))
                        for policy in args.policies:
                            measured = await run_policy(bed, policy, workload, args.model_path,
                                                        seed, warmup=args.warmup)
                            row: dict[str, Any] = {
                                "policy": policy, "delay_ms": delay_ms, "load": load,
                                "rate_per_s": rates[load], "run": run, "seed": seed,
                                **summarise(measured),
                                "shares": list(args.shares), "model": args.model,
                                "quick": args.quick, "peer_args": args.peer_args,
                                # the machine's 1-minute load average: other work on the box
                                # takes CPU the quotas promise (2 cores here)
                                "loadavg_1m": round(os.getloadavg()[0], 2),
                            }
                            pred = predict(setup, policy, delay_ms, workload, seed)
                            row["predicted_ttft_mean_s"] = pred.ttft_mean_s
                            row["predicted_busiest_peer_utilization"] = (
                                pred.busiest_peer_utilization)
                            row["predicted_hit_ratio"] = pred.hit_ratio
                            row["predicted_served_per_peer"] = list(pred.served_per_peer)
                            row["predicted_peer_utilization"] = [
                                round(u, 4) for u in pred.peer_utilization]
                            row["predicted_advertised_tokens_per_s"] = [
                                list(a) for a in pred.advertised]
                            for key, value in pred.per_entry.items():
                                row[f"predicted_{key}"] = value
                            if args.traces:
                                write_trace(args.traces, row, measured)
                            result["rows"].append(row)
                            save()
                            log(f"d={delay_ms:g} ms {load} run {run} {policy}: ttft "
                                f"{row['ttft_mean_s']:.3f} s (sim {pred.ttft_mean_s:.3f}) "
                                f"hit {row['hit_ratio']:.2f} busiest "
                                f"{row['busiest_peer_utilization']:.2f} fwd "
                                f"{row['forwarded_fraction']:.2f} failed {row['failed']} "
                                f"peers {row['peer_utilization']} {events_line(row)}")
            result["link_stats"] = bed.link_stats()
    result["complete"] = True
    result["params"]["machine"] = (f"{os.cpu_count()} CPUs, load average "
                                   f"{os.getloadavg()[0]:.1f} at end")
    save()
    return result


class Stopped(Exception):
    """SIGTERM or SIGHUP arrived: everything built has been torn down."""


async def run_until_signalled(args: argparse.Namespace) -> dict[str, Any]:
    """main_async, cancelled (and so torn down: peers, namespaces, emulator, CPU groups)
    on SIGTERM or SIGHUP as on Ctrl-C."""
    result: dict[str, Any] = {}
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            async def work() -> None:
                result.update(await main_async(args))
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(work)
    if not result:
        raise Stopped()
    return result


def _interrupted(path: str) -> None:
    print(f"bench.testbed: interrupted; everything torn down; rows so far are in {path}",
          file=sys.stderr)
    sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.no_isolation:
        from bench.testbed.net import check_support

        missing = check_support()
        if missing:
            print(f"bench.testbed: {missing}", file=sys.stderr)
            sys.exit(2)
    try:
        result = trio.run(run_until_signalled, args)
    except (KeyboardInterrupt, Stopped):
        _interrupted(args.json)
    except BaseExceptionGroup as group:  # Ctrl-C inside a nursery arrives grouped
        if group.split((KeyboardInterrupt, Stopped))[1] is not None:
            raise
        _interrupted(args.json)
    emit_json({"summary": result["summary"], "params": result["params"]}, None)


if __name__ == "__main__":
    main()

