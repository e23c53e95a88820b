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
