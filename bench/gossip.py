"""Gossip cost and propagation delay with one peer per OS process.

    python -m bench.gossip --json PATH [--peers 8] [--duration 60] [--interval 2]
        [--gossip-modes full,ring] [--runs 1] [--neighbours 8]
        [--model tiny-random --serve-rps 2]

Swarms of `--peers` runner processes (peer.node_runner: cache-only engines with churning
content, or with `--model` a real model under a steady load), one after the other: a
baseline with publishing off, then `--runs` runs per gossip mode, each a fresh swarm.
Every run reports the fraction of (summary, receiver) pairs delivered and the p99
propagation delay in summary intervals; `delivery` gathers them per mode, run by run.
Per peer: the CPU and bytes that gossip costs (run minus baseline) and the delay from
publish to acceptance (each key is defined in `bench()`). CPU shares mean something only
on a quiet machine: the JSON records the load average of every run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.report import emit_json
from bench.stats import percentile
from peer.config import DEFAULT_GOSSIP_NEIGHBOURS, GossipMode
from peer.node_runner import runner_command
from peer.processes import PeerProcess, open_peer_processes
from peer.swarm.neighbourhood import Neighbourhood

REPO_ROOT = Path(__file__).resolve().parent.parent
WARMUP_TIMEOUT_S = 120.0  # 8 interpreters starting at once on 2 busy cores: ~20-60 s
BASELINE_CONNECT_S = 30.0  # see _run_swarm
SETTLE_S = 3.0  # after the tables filled: let meshes settle before measuring
REPORT_INTERVAL_S = 1.0  # runner report period: coarse enough to cost little CPU


def _window(proc: PeerProcess, start: float, end: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first and last reports of `proc` with wall time inside [start, end]."""
    inside = [r for r in proc.reports if start <= r["t"] <= end]
    if len(inside) < 2:
        raise RuntimeError(f"peer {proc.peer_id}: too few reports in the window")
    return inside[0], inside[-1]


def _rates(proc: PeerProcess, start: float, end: float) -> dict[str, float]:
    first, last = _window(proc, start, end)
    wall = last["t"] - first["t"]
    p0, p1 = first["process"], last["process"]
    g0, g1 = first["stats"]["gossip"], last["stats"]["gossip"]
    io0 = p0["wire_sent"] + p0["wire_received"]
    io1 = p1["wire_sent"] + p1["wire_received"]
    l0, l1 = first["stats"].get("lookup") or {}, last["stats"].get("lookup") or {}

    def lookup_delta(*keys: str) -> float:
        return float(sum(l1.get(k, 0) - l0.get(k, 0) for k in keys))

    summary_bytes = g1["bytes_in"] + g1["bytes_out"] - g0["bytes_in"] - g0["bytes_out"]
    lookup_bytes = lookup_delta("bytes_in", "bytes_out")
    return {
        "cpu_share": (p1["cpu_s"] - p0["cpu_s"]) / wall,
        "handler_cpu_share": (g1["cpu_s"] - g0["cpu_s"]) / wall,
        "payload_bytes_per_s": (summary_bytes + lookup_bytes) / wall,
        "summary_bytes_per_s": summary_bytes / wall,
        "lookup_bytes_per_s": lookup_bytes / wall,
        "lookup_messages_per_s": lookup_delta(
            "requests_sent", "announcements_answered", "finds_answered",
            "summary_queries_answered",
        ) / wall,
        "lookups_per_s": lookup_delta("lookups") / wall,
        "wire_bytes_per_s": (io1 - io0) / wall,
        "published_per_s": (g1["published"] - g0["published"]) / wall,
        "rejected": float(g1["rejected_total"]),
        "superseded": float(g1["superseded"] - g0["superseded"]),
        "rejected_by_reason": g1["rejected"],
    }


def expected_neighbours(ids: set[str], neighbours: int) -> dict[str, frozenset[str]]:
    """Each peer's ring neighbourhood when it knows every other peer."""
    return {p: Neighbourhood(p, neighbours).select(ids) for p in ids}


async def _run_swarm(
    args: argparse.Namespace,
    workdir: Path,
    *,
    publish: bool,
    measure_s: float,
    mode: str,
    readiness: dict[str, Any],
) -> tuple[list[PeerProcess], float, float]:
    """Start the swarm, wait for full tables (or connections), measure, stop."""
    common = [
        "--interval", str(args.interval),
        "--fill-blocks", str(args.fill_blocks),
        "--churn-tokens-per-s", str(args.churn_tokens_per_s),
        "--report-interval", str(REPORT_INTERVAL_S),
        "--count-wire-bytes",
        "--gossip-mode", mode,
        "--neighbours", str(args.neighbours),
    ]  # fmt: skip
    if args.model:
        common += ["--model", args.model, "--serve-rps", str(args.serve_rps)]
    if publish:
        common.append("--log-gossip")
    else:
        common.append("--no-publish")
    log = workdir / (f"gossip-{mode}.stderr" if publish else "baseline.stderr")
    async with open_peer_processes(cwd=REPO_ROOT) as processes:

        async def launch(extra: list[str]) -> PeerProcess:
            command = runner_command([*common, *extra])
            proc = await processes.start(command, log_path=log, keep_reports=True)
            await proc.wait_up(WARMUP_TIMEOUT_S)
            return proc

        first = await launch(["--seed", "0"])
        procs: list[PeerProcess] = [first]

        async def spawn(i: int) -> None:
            procs.append(await launch(["--seed", str(i), "--bootstrap", first.multiaddrs[0]]))

        async with trio.open_nursery() as starting:
            for i in range(1, args.peers):
                starting.start_soon(spawn, i)

        ids = {p.peer_id for p in procs}
        hoods = expected_neighbours(ids, args.neighbours)

        def ready() -> bool:
            if publish and mode == GossipMode.RING.value:
                return all(p.known >= hoods[p.peer_id] for p in procs)
            if publish:
                return all(p.known == ids - {p.peer_id} for p in procs)
            return all((p.stats or {}).get("peers_connected", 0) >= args.peers - 1 for p in procs)

        # The gossip run waits for every table to fill, at most --ready-timeout (then it
        # measures anyway and says how full the tables were: on a busy machine a large
        # full-mode swarm may never get there); the baseline (no summaries) waits for
        # full connectivity, but at most BASELINE_CONNECT_S (discovery backs off there).
        waited = time.monotonic()
        with trio.move_on_after(args.ready_timeout if publish else BASELINE_CONNECT_S):
            while not ready():
                await trio.sleep(0.2)
        wanted = {
            p.peer_id: hoods[p.peer_id]
            if mode == GossipMode.RING.value
            else frozenset(ids - {p.peer_id})
            for p in procs
        }
        fill = [len(p.known & wanted[p.peer_id]) / max(1, len(wanted[p.peer_id])) for p in procs]
        readiness[mode if publish else "baseline"] = {
            "ready": ready(),
            "waited_s": time.monotonic() - waited,
            "table_fill_mean": statistics.mean(fill),
            "table_fill_min": min(fill),
        }
        await trio.sleep(SETTLE_S)
        start = time.time()
        print(
            f"{mode if publish else 'baseline'}: measuring {measure_s:.0f} s", file=sys.stderr
        )
        await trio.sleep(measure_s)
        end = time.time()
        await trio.sleep(max(1.0, 2 * args.interval))  # late receipts of the last summaries
    return procs, start, end


WORST_PAIRS = 5  # (receiver, sender) pairs with the most missed summaries, per run


def _propagation(
    procs: list[PeerProcess], start: float, end: float, audience: dict[str, set[str]]
) -> dict[str, Any]:
    """Delays from publish to acceptance over (summary, receiver in its audience) pairs,
    and the receiver/sender pairs that missed summaries."""
    published: dict[tuple[str, int], float] = {}
    for p in procs:
        for ev in p.events:
            if ev["event"] == "published" and start <= ev["t"] <= end:
                published[(p.peer_id, ev["seq"])] = ev["t"]
    delays: list[float] = []
    received: dict[tuple[str, str], int] = {}  # (receiver, sender) -> summaries delivered
    for p in procs:
        for ev in p.events:
            if ev["event"] == "accepted" and p.peer_id in audience.get(ev["sender"], ()):
                sent = published.get((ev["sender"], ev["seq"]))
                if sent is not None:
                    delays.append(ev["t"] - sent)
                    pair = (p.peer_id, ev["sender"])
                    received[pair] = received.get(pair, 0) + 1
    sent_by: dict[str, int] = {}
    for sender, _seq in published:
        sent_by[sender] = sent_by.get(sender, 0) + 1
    missed = sorted(
        (
            (sent_by[sender] - received.get((receiver, sender), 0), receiver, sender)
            for sender in sent_by
            for receiver in audience[sender]
        ),
        reverse=True,
    )
    expected = sum(len(audience[sender]) for sender, _ in published)
    return {
        "summaries": float(len(published)),
        "delivered_fraction": len(delays) / expected if expected else float("nan"),
        "p50_s": percentile(delays, 0.50),
        "p99_s": percentile(delays, 0.99),
        "max_s": max(delays, default=float("nan")),
        "pairs_missing": sum(1 for n, _r, _s in missed if n > 0),
        "worst_pairs": [
            {"receiver": r, "sender": s, "missed": n, "published": sent_by[s]}
            for n, r, s in missed[:WORST_PAIRS]
            if n > 0
        ],
    }


def _audience(procs: list[PeerProcess], mode: str, neighbours: int) -> dict[str, set[str]]:
    ids = {p.peer_id for p in procs}
    if mode != GossipMode.RING.value:
        return {p: ids - {p} for p in ids}
    out: dict[str, set[str]] = {p: set() for p in ids}
    for receiver, hood in expected_neighbours(ids, neighbours).items():
        for sender in hood:
            out[sender].add(receiver)
    return out


def _served(procs: list[PeerProcess]) -> dict[str, int]:
    """Requests of the steady load, summed over peers (last reports)."""
    total = {"ok": 0, "failed": 0, "skipped": 0}
    for p in procs:
        last = p.reports[-1]["stats"].get("served_load", {}) if p.reports else {}
        for key in total:
            total[key] += int(last.get(key, 0))
    return total


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "t": time.time()}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """A baseline run (publishing off, for `--baseline-duration`, mode full: discovery,
    DHT, pings, heartbeats, reports and the served load still run), then one run per
    `--gossip-modes`, summaries every `--interval` s for `--duration` s once every table
    filled (mode ring: each peer's `--neighbours` ring neighbours).

    What is measured, per peer process:
    - cpu_share_per_peer: process CPU time / wall time in the gossip run minus the same in
      the baseline run (both from getrusage), i.e. the extra CPU that gossip costs, pubsub
      signing, relaying, Noise and yamux included. The mean over peers is the headline;
      `handler_cpu_share_per_peer` is only the time inside our publish/validate code
      (thread CPU time), a lower bound.
    - gossip_bytes_per_s_per_peer: summary payload bytes sent + received per second
      (protobuf framing, signatures and relayed copies excluded), plus in mode ring the
      lookup protocol's frames (peer/swarm/lookup.py: announcements, finds, summary queries and
      their replies); `summary_bytes_per_s_per_peer` and `lookup_bytes_per_s_per_peer` are
      the two parts, `lookup_messages_per_s_per_peer` the lookup requests sent + answered.
      `wire_bytes_per_s_per_peer` is all libp2p TCP traffic sent + received (after Noise and
      yamux; counted in peer.net.host.count_wire_bytes), gossip run minus baseline run.
    - propagation delay: every runner logs (seq, wall time) when it publishes and
      (sender, seq, wall time) when it accepts another peer's summary; all run on this
      machine, so one clock. p50/p99 over all (summary, receiver) pairs in the window, and
      the fraction of such pairs that arrived at all. In mode ring the pairs are a summary
      and each peer whose neighbourhood holds its sender (its audience).
    """
    modes = args.gossip_modes.split(",")
    runs: list[dict[str, Any]] = []
    readiness: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gossip-") as tmp:
        workdir = Path(tmp)
        machine_base = [_machine()]
        base_procs, b0, b1 = await _run_swarm(
            args, workdir, publish=False, measure_s=args.baseline_duration, mode="full",
            readiness=readiness,
        )
        machine_base.append(_machine())
        base = [_rates(p, b0, b1) for p in base_procs]
        base_cpu = statistics.mean(r["cpu_share"] for r in base)
        base_wire = statistics.mean(r["wire_bytes_per_s"] for r in base)
        for mode, run in [(m, i) for m in modes for i in range(args.runs)]:
            machine = [_machine()]
            procs, g0, g1 = await _run_swarm(
                args, workdir, publish=True, measure_s=args.duration, mode=mode,
                readiness=readiness,
            )
            machine.append(_machine())
            rates = [_rates(p, g0, g1) for p in procs]
            prop = _propagation(procs, g0, g1, _audience(procs, mode, args.neighbours))
            cpu = [r["cpu_share"] - base_cpu for r in rates]
            print(
                f"{mode} run {run + 1}/{args.runs}: delivered "
                f"{prop['delivered_fraction']:.4f}, p99 "
                f"{prop['p99_s'] / args.interval:.2f} intervals, load {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
            )
            runs.append({
                "gossip_mode": mode,
                "run": run,
                "peers": args.peers,
                "neighbours": args.neighbours if mode == GossipMode.RING.value else None,
                "duration_s": args.duration,
                "interval_s": args.interval,
                "gossip_bytes_per_s_per_peer": statistics.mean(
                    r["payload_bytes_per_s"] for r in rates),
                "summary_bytes_per_s_per_peer": statistics.mean(
                    r["summary_bytes_per_s"] for r in rates),
                "lookup_bytes_per_s_per_peer": statistics.mean(
                    r["lookup_bytes_per_s"] for r in rates),
                "lookup_messages_per_s_per_peer": statistics.mean(
                    r["lookup_messages_per_s"] for r in rates),
                "lookups_per_s_per_peer": statistics.mean(r["lookups_per_s"] for r in rates),
                "cpu_share_per_peer": statistics.mean(cpu),
                "propagation_p50_s": prop["p50_s"],
                "propagation_p99_s": prop["p99_s"],
                "propagation_p99_intervals": prop["p99_s"] / args.interval,
                "propagation_max_s": prop["max_s"],
                "delivered_fraction": prop["delivered_fraction"],
                "pairs_missing": prop["pairs_missing"],
                "worst_pairs": prop["worst_pairs"],
                "summaries_published": prop["summaries"],
                "cpu_share_per_peer_max": max(cpu),
                "handler_cpu_share_per_peer": statistics.mean(
                    r["handler_cpu_share"] for r in rates),
                "process_cpu_share_gossip_run": statistics.mean(r["cpu_share"] for r in rates),
                "process_cpu_share_baseline_run": base_cpu,
                "wire_bytes_per_s_per_peer": statistics.mean(
                    r["wire_bytes_per_s"] for r in rates) - base_wire,
                "published_per_s_per_peer": statistics.mean(r["published_per_s"] for r in rates),
                "summaries_rejected": sum(r["rejected"] for r in rates),
                "summaries_superseded": sum(r["superseded"] for r in rates),
                "served_load": _served(procs),
                "tables": readiness[mode],
                "machine": machine,
                "per_peer": rates,
            })  # fmt: skip
    return {
        "peers": args.peers,
        "delivery": {
            mode: {
                "delivered_fraction": [r["delivered_fraction"] for r in by_mode],
                "propagation_p99_intervals": [r["propagation_p99_intervals"] for r in by_mode],
                "delivered_fraction_min": min(r["delivered_fraction"] for r in by_mode),
                "propagation_p99_intervals_max": max(
                    r["propagation_p99_intervals"] for r in by_mode
                ),
            }
            for mode in modes
            for by_mode in [[r for r in runs if r["gossip_mode"] == mode]]
        },
        "runs": runs,
        "settings": {
            "fill_blocks": args.fill_blocks,
            "churn_tokens_per_s": args.churn_tokens_per_s,
            "baseline_duration_s": args.baseline_duration,
            "model": args.model,
            "serve_rps": args.serve_rps,
            "neighbours": args.neighbours,
            "runs": args.runs,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "baseline": machine_base,
            "baseline_tables": readiness.get("baseline"),
            "note": "CPU shares are inflated on a busy machine: compare the load averages",
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gossip",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", type=Path, required=True, help="write results here")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0, help="gossip run, s")
    parser.add_argument("--baseline-duration", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=2.0, help="summary interval, s")
    parser.add_argument("--fill-blocks", type=int, default=728, help="half of 1456 capacity")
    parser.add_argument("--churn-tokens-per-s", type=float, default=64.0)
    parser.add_argument("--ready-timeout", type=float, default=WARMUP_TIMEOUT_S,
                        help="s to wait for full tables before measuring anyway")
    parser.add_argument("--gossip-modes", default="full,ring",
                        help="comma-separated gossip modes to measure, one swarm each")
    parser.add_argument("--runs", type=int, default=1,
                        help="swarms per gossip mode, one after the other")
    parser.add_argument("--neighbours", type=int, default=DEFAULT_GOSSIP_NEIGHBOURS,
                        help="mode ring: neighbours each peer hears")
    parser.add_argument("--model", default=None,
                        help="a real model (tiny-random) instead of cache-only engines")
    parser.add_argument("--serve-rps", type=float, default=0.0,
                        help="with --model: steady requests per second sent to each peer")
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be >= 2")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    known = {m.value for m in GossipMode}
    if not args.gossip_modes or set(args.gossip_modes.split(",")) - known:
        parser.error(f"--gossip-modes takes a comma-separated subset of {sorted(known)}")
    if args.serve_rps and not args.model:
        parser.error("--serve-rps needs --model")
    result = trio.run(bench, args)
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
