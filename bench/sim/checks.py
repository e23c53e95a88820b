"""Checks over result rows: the claims the sweeps are run for (cost against the best
deployable policy, the scale targets of ring gossip, hit ratio against the oracle's). Pure
functions of the rows, used by bench.simulate, the plots and the tests."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.sim.experiments import DEPLOYABLE, REQUIRED_ROW_KEYS
from bench.sim.params import ORACLE
from peer.config import GossipMode, Policy

POINT_KEYS = ("regime", "seed", "workload", "experiment", "peers", "delay_ms", "zipf_s",
              "load", "summary_interval_s", "bloom_bits_per_entry", "capacity_blocks")


def point_of(r: dict[str, Any], keys: Sequence[str] = POINT_KEYS) -> tuple[Any, ...]:
    """A row's sweep point (rows written before regimes and seeds read as cpu, seed 1)."""
    defaults = {"regime": "cpu", "seed": 1, "workload": "mmlu", "capacity_blocks": None}
    return tuple(r.get(k, defaults.get(k)) for k in keys)


def compare_cost(rows: Sequence[dict[str, Any]], metric: str, experiments: Iterable[str],
                 policy: str = Policy.COST.value) -> list[dict[str, Any]]:
    """Per sweep point (and seed): `policy`'s `metric` against the best deployable policy
    (DEPLOYABLE: the oracle, the cost variants and the ceiling excluded)."""
    wanted = set(experiments)
    points: dict[tuple[Any, ...], dict[str, float]] = {}
    for r in rows:
        if r["experiment"] not in wanted:
            continue
        points.setdefault(point_of(r), {})[r["policy"]] = r[metric]
    out = []
    for key, by_policy in points.items():
        if policy not in by_policy:
            continue
        others = {p: v for p, v in by_policy.items() if p in DEPLOYABLE}
        if not others:
            continue
        best_policy = min(others, key=lambda p: others[p])
        cost = by_policy[policy]
        best = others[best_policy]
        out.append({
            **dict(zip(POINT_KEYS, key, strict=True)), "policy": policy, "metric": metric,
            "cost": cost, "best_other": best, "best_other_policy": best_policy,
            "ratio": cost / best if best > 0 else math.inf,
        })  # fmt: skip
    return out


def scale_checks(rows: Sequence[dict[str, Any]], mode: str = GossipMode.RING.value,
                 policy: str = Policy.COST.value) -> dict[str, Any]:
    """The scale targets from the scale rows: `mode` against full flooding at the largest
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
            oracle[point_of(r)] = r["hit_ratio"]
    out = []
    for r in rows:
        o = oracle.get(point_of(r))
        if o is None or r["policy"] == ORACLE:
            continue
        out.append({**{k: r[k] for k in REQUIRED_ROW_KEYS[:6]},
                    "hit_ratio": r["hit_ratio"], "oracle_hit_ratio": o,
                    "of_oracle": r["hit_ratio"] / o if o > 0 else math.nan})
    return out


HELD_OUT_EXPERIMENTS = ("delay", "skew", "load")  # the quick grid's sweeps
HELD_OUT_MEAN_RATIO = 1.05  # cost within 5% of the best deployable policy, seeds' mean
HELD_OUT_SEED_RATIO = 1.15  # ... and no single seed more than 15% behind
BUSY = 0.9  # the load sweep's top point: the busiest peer at least this busy under cost
BUSY_ORACLE_RATIO = 1.3  # cost / oracle there


def held_out(rows: Sequence[dict[str, Any]], metric: str = "ttft_mean_s",
             policy: str = Policy.COST.value) -> dict[str, Any]:
    """The held-out-seed targets over rows of several workload seeds: per point and seed,
    and per point on the seeds' mean, `policy`'s `metric` over the best deployable
    policy's; and in the load sweep, per regime, `policy` over the oracle at each load
    where the busiest peer is >= BUSY busy under `policy` (seeds' mean), the target
    applying to the lowest such load."""
    per_seed = compare_cost(rows, metric, HELD_OUT_EXPERIMENTS, policy)
    seedless = tuple(k for k in POINT_KEYS if k != "seed")  # regime first, load 7th
    values: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    busy: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        if r["experiment"] in HELD_OUT_EXPERIMENTS:
            key = point_of(r, seedless)
            values.setdefault(key, {}).setdefault(r["policy"], []).append(r[metric])
            if r["policy"] == policy and "busiest_peer_utilization" in r:
                busy.setdefault(key, []).append(r["busiest_peer_utilization"])
    means = []
    for key, by_policy in values.items():
        avg = {p: sum(v) / len(v) for p, v in by_policy.items()}
        others = {p: v for p, v in avg.items() if p in DEPLOYABLE}
        if policy not in avg or not others:
            continue
        best = min(others, key=lambda p: others[p])
        means.append({**dict(zip(seedless, key, strict=True)), "seeds": len(by_policy[policy]),
                      "cost": avg[policy], "best_other": others[best],
                      "best_other_policy": best, "ratio": avg[policy] / others[best]})
    top: list[dict[str, Any]] = []
    for key, utils in sorted(busy.items(), key=lambda kv: (kv[0][0], kv[0][6])):
        point = dict(zip(seedless, key, strict=True))  # sorted by regime, then load
        avg = {p: sum(v) / len(v) for p, v in values[key].items()}
        util = sum(utils) / len(utils)
        if point["experiment"] != "load" or not util >= BUSY or ORACLE not in avg:
            continue
        first = not any(t["regime"] == point["regime"] for t in top)
        top.append({"regime": point["regime"], "load": point["load"],
                    "busiest_peer_utilization": util, "cost": avg[policy],
                    "oracle": avg[ORACLE], "ratio": avg[policy] / avg[ORACLE],
                    "target_applies": first})
    regimes = sorted({m["regime"] for m in means})
    targets = {
        "mean_within_5pct": all(m["ratio"] <= HELD_OUT_MEAN_RATIO for m in means),
        "each_seed_within_15pct": all(c["ratio"] <= HELD_OUT_SEED_RATIO for c in per_seed),
        "busy_load_reached": all(any(t["regime"] == g for t in top) for g in regimes),
        "busy_cost_over_oracle_le_1_3": all(
            t["ratio"] <= BUSY_ORACLE_RATIO for t in top if t["target_applies"]),
    }
    return {"metric": metric, "policy": policy,
            "seeds": sorted({c["seed"] for c in per_seed}), "targets": targets,
            "pass": all(targets.values()), "mean": means, "per_seed": per_seed,
            "busy_load": top}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.sim.checks RESULT.json`: the held-out-seed check of a result file
    (bench.simulate --json) as JSON."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m bench.sim.checks", description=main.__doc__)
    ap.add_argument("result", type=Path)
    ap.add_argument("--metric", default="ttft_mean_s")
    args = ap.parse_args(argv)
    rows = json.loads(args.result.read_text())["rows"]
    print(json.dumps(held_out(rows, args.metric), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
