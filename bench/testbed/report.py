"""docs/RESULTS.md's testbed section, generated from the committed testbed rows.

    python -m bench.claims        # writes the page, this section included

Per point (delay, load) and policy: the measured mean TTFT over runs with its 95%
interval (bench.stats.mean_ci95), the simulator's prediction on the same workload and
calibrations, their ratio, hit ratio, forwarded fraction and the busiest peer's measured
utilisation; then the issue's checks, each computed from the rows: `cost` lowest of the
deployable policies, its interval clear of random's and local's, within 5% of
longest_prefix, and every prediction within 25% of the measurement. `summary` gives a
result file its per-point means and intervals (the bench and `repredict` write it).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.stats import mean_ci95

Row = dict[str, Any]
POLICIES = ("cost", "longest_prefix", "local", "random", "least_loaded")
PREDICTION_TOLERANCE = 0.25  # |predicted / measured - 1|
LONGEST_PREFIX_MARGIN = 1.05
COMMAND = ("sudo .venv/bin/python -m bench.testbed --json docs/results/testbed.json && "
           ".venv/bin/python -m bench.testbed.repredict --json docs/results/testbed.json")


# the row metrics a result's `summary` gives per point
ROW_KEYS = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "hit_ratio", "busiest_peer_utilization",
            "predicted_ttft_mean_s", "forwarded_fraction")


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (delay, load, policy): mean and 95% half-width over runs of each row metric."""
    groups: dict[tuple[float, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["delay_ms"], r["load"], r["policy"]), []).append(r)
    out = []
    for (delay, load, policy), rs in groups.items():
        entry: dict[str, Any] = {"delay_ms": delay, "load": load, "policy": policy,
                                 "runs": len(rs)}
        for key in ROW_KEYS:
            vals = [float(r[key]) for r in rs if r.get(key) is not None]
            m, half = mean_ci95(vals)
            entry[key] = m
            entry[f"{key}_ci95"] = half
        out.append(entry)
    return out


def _points(rows: Sequence[Row]) -> dict[tuple[float, str], dict[str, list[Row]]]:
    out: dict[tuple[float, str], dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[(float(r["delay_ms"]), str(r["load"]))][str(r["policy"])].append(r)
    return out


def _mean(rows: Sequence[Row], key: str) -> tuple[float, float]:
    return mean_ci95([float(r[key]) for r in rows if r.get(key) is not None])


def _fmt(m: float, h: float) -> str:
    if math.isnan(m):
        return "-"
    return f"{m:.3f}" if math.isnan(h) else f"{m:.3f} ± {h:.3f}"


def _at_run(rows: Sequence[Row]) -> float:
    """The mean TTFT the simulator of the run predicted (before a repredict)."""
    vals = [float(r["predicted_at_run"]["predicted_ttft_mean_s"]) for r in rows
            if (r.get("predicted_at_run") or {}).get("predicted_ttft_mean_s") is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _rates(params: dict[str, Any]) -> str:
    """The loads' rates, and how they were chosen (measured by pilots since the loads are
    named by the non-routing swarm's busiest peer)."""
    rates = ", ".join(f"{k} {v:.1f}" for k, v in params.get("rates_per_s", {}).items())
    if params.get("rates_from") == "pilots":
        targets = ", ".join(f"{k} {v:g}" for k, v in params.get("loads", {}).items())
        return (f"{rates}, the rates at which two `{params.get('load_policy')}` pilot runs "
                f"put the busiest peer at {targets} busy")
    return rates


def _fmt_util(u: float) -> str:
    return "-" if math.isnan(u) else f"{u:.2f}"


def _clear(cost: tuple[float, float], other: tuple[float, float] | None) -> bool | None:
    """Whether cost's 95% interval lies wholly below `other`'s (None: no interval)."""
    if other is None or math.isnan(cost[1]) or math.isnan(other[1]):
        return None
    return cost[0] + cost[1] < other[0] - other[1]


def checks(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per point, the issue's targets as booleans, with the numbers behind them."""
    out = []
    for (delay, load), by_policy in sorted(_points(rows).items()):
        stats = {p: _mean(rs, "ttft_mean_s") for p, rs in by_policy.items()}
        if "cost" not in stats:
            continue
        cm = stats["cost"][0]
        lowest = all(cm <= m for p, (m, _) in stats.items() if p != "cost")
        lp = stats.get("longest_prefix", (math.nan, math.nan))[0]
        ratios = {}
        for p, rs in by_policy.items():
            measured = _mean(rs, "ttft_mean_s")[0]
            predicted = _mean(rs, "predicted_ttft_mean_s")[0]
            ratios[p] = predicted / measured if measured > 0 else math.nan
        out.append({
            "delay_ms": delay, "load": load, "cost_lowest": lowest,
            "cost_clear_of_random": _clear(stats["cost"], stats.get("random")),
            "cost_clear_of_local": _clear(stats["cost"], stats.get("local")),
            "cost_within_5pct_of_longest_prefix": (
                None if math.isnan(lp) else cm <= LONGEST_PREFIX_MARGIN * lp),
            "predictions_within_25pct": all(
                abs(r - 1) <= PREDICTION_TOLERANCE for r in ratios.values()),
            "predicted_over_measured": ratios,
        })
    return out


TITLE = "The testbed: real peers on small machines, next to the simulator"


def _paced(params: dict[str, Any]) -> str:
    """How the warm-up arrived, where a run paced it (bench/testbed/workload.py)."""
    paces = {k: v for k, v in (params.get("warmup_pace") or {}).items() if v > 1.0}
    if not paces:
        return ""
    faster = ", ".join(f"{v:g}x faster at {k}" for k, v in paces.items())
    return f" (arriving {faster}, then {params.get('warmup_pause_s', 0):g} s of pause)"


def _entry_means(rows: Sequence[Row], key: str) -> list[float]:
    """Per entry peer, the mean over runs of a per-entry list (NaN where no run has one)."""
    width = max((len(r.get(key) or ()) for r in rows), default=0)
    out = []
    for i in range(width):
        vals = [float(r[key][i]) for r in rows if r.get(key) and r[key][i] is not None]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _pairs(real: Sequence[float], sim: Sequence[float], digits: int) -> str:
    def one(v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.{digits}f}"

    return ", ".join(f"{one(a)} / {one(b)}" for a, b in zip(real, sim, strict=True))


def _per_entry(by_policy: dict[str, list[Row]]) -> list[str]:
    """The point's per-entry table (rows with `served_matrix` only: older runs have no
    per-entry prediction): each entry peer's TTFT, hit ratio and forwarded fraction,
    measured / simulated, and where its requests went (the served matrix, summed over
    runs, measured then simulated)."""
    if not any(r.get("served_matrix") for rs in by_policy.values() for r in rs):
        return []
    lines = ["Per entry peer (bed order; measured / simulated, means over runs; `sent to`: "
             "row i lists how many of entry i's requests each peer served, summed over "
             "runs):", "",
             "| policy | TTFT | hit | forwarded | sent to, measured | sent to, simulated |",
             "|---|---|---|---|---|---|"]
    for policy in POLICIES:
        rs = [r for r in by_policy.get(policy, []) if r.get("served_matrix")]
        if not rs:
            continue

        def mean(key: str, rows: Sequence[Row] = rs) -> list[float]:
            return _entry_means(rows, key)

        def summed(key: str, rows: Sequence[Row] = rs) -> str:
            total = [[sum(r[key][i][j] for r in rows) for j in range(len(rows[0][key]))]
                     for i in range(len(rows[0][key]))]
            return "; ".join(" ".join(str(n) for n in row) for row in total)

        def both(key: str, digits: int) -> str:
            return _pairs(mean(key), mean(f"predicted_{key}"), digits)

        lines.append(
            f"| {policy} | {both('ttft_mean_per_entry_s', 3)} | "
            f"{both('hit_ratio_per_entry', 2)} | {both('forwarded_fraction_per_entry', 2)} | "
            f"{summed('served_matrix')} | {summed('predicted_served_matrix')} |")
    lines.append("")
    return lines


def section(path: Path, title: str = TITLE, command: str = COMMAND) -> str:
    """A testbed section of the page (the full run's, or a what-if's with its own title
    and command); a line saying there are no rows when `path` is absent."""
    if not path.is_file():
        return f"## {title}\n\nNo rows are committed yet (`{command}`).\n"
    data = json.loads(path.read_text())
    rows: list[Row] = data["rows"]
    params = data.get("params", {})
    lines = [
        f"## {title}",
        "",
        f"`{command}` ({len(rows)} rows, docs/testbed.md). "
        f"{len(params.get('shares', []))} peers of {params.get('model')} with CPU shares "
        f"{params.get('shares')} of a core, each in its own network namespace, every byte "
        f"between peers through the link emulator ({params.get('bandwidth_mbit')} Mbit/s); "
        f"{params.get('requests')} measured requests per policy run after "
        f"{params.get('warmup_requests', 0)} unmeasured ones{_paced(params)}, "
        f"{params.get('runs')} runs "
        f"per point (seed + run), a fresh swarm per policy run, default trust settings. "
        f"Arrival rates (requests/s): {_rates(params)}. "
        "TTFT in seconds: the mean over runs ± the half-width of its 95% interval; "
        "`sim` is the simulator's prediction on the same workload and measured "
        "calibrations; `util` the busiest peer's measured utilisation (its CPU over its "
        "share) and `sim util` the simulator's for it.",
        "",
    ]
    forward = data.get("forward_cost")
    if forward:
        lines += [
            "Calibrated per-request costs outside the engine's steps (ms at each peer's "
            "usable share, peer by peer): serving, before the first token and after "
            + ", ".join(f"{c['calibration'].get('request_overhead_s', 0.0) * 1e3:.1f} + "
                        f"{c['calibration'].get('request_tail_s', 0.0) * 1e3:.1f}"
                        for c in data.get("calibration", []))
            + "; forwarding, at the entry "
            + ", ".join(f"{c['calibration'].get('forward_overhead_s', 0.0) * 1e3:.1f}"
                        for c in data.get("calibration", []))
            + f" ({forward['forwarded_cpu_s'] * 1e3:.1f} ms of CPU, measured on "
            f"{forward['forwarded']} forwards)"
            + ("" if not forward.get("served_cpu_s") else
               "; serving a forward, beyond a request of its own client, "
               + ", ".join(f"{c['calibration'].get('served_overhead_s', 0.0) * 1e3:.1f}"
                           for c in data.get("calibration", [])))
            + ".",
            "",
        ]
    pilot = data.get("forward_pilot")
    again = params.get("repredicted")
    if pilot and not again:
        lines += [
            f"The forward pilot ({len(pilot.get('runs', []))} {pilot['policy']} runs at "
            f"{pilot['rate_per_s']:.2f} requests/s, d = {pilot['delay_ms']:g} ms) put a "
            f"forward at {pilot['forward_cpu_s'] * 1e3:.1f} ms of CPU at its entry beyond "
            "what the simulator charged (0: too few forwards to tell); the predictions "
            "charge it.",
            "",
        ]
    if again:
        lines += [
            f"The predictions were made again by today's simulator ({again.get('by')}, "
            f"{again.get('at')}) from the run's calibration"
            + (", each peer's CPU per request times its factor from the load pilots ("
               + ", ".join(f"{f:.2f}" for f in again["cpu_factors"])
               + ": what its requests took in the running swarm over what the simulator "
               "charged for them on the calibration measured alone)"
               if again.get("cpu_factors") else "")
            + (f", and each forward {again['forward_cpu_s'] * 1e3:.1f} ms of CPU at its "
               f"entry beyond what the simulator charged (from {again['forward_cpu_from']})"
               if again.get("forward_cpu_from") else "")
            + "; `sim at run` is what the simulator of the run predicted.",
            "",
        ]
    for (delay, load), by_policy in sorted(_points(rows).items()):
        lines += [f"### d = {delay:g} ms, load {load}", "",
                  "| policy | TTFT mean | sim | sim / real | hit | forwarded | util | sim util "
                  + ("| sim at run " if again else "") + "| runs |",
                  "|---|---|---|---|---|---|---|---|" + ("---|" if again else "") + "---|"]
        for policy in POLICIES:
            rs = by_policy.get(policy)
            if not rs:
                continue
            m, h = _mean(rs, "ttft_mean_s")
            sim = _mean(rs, "predicted_ttft_mean_s")[0]
            ratio = sim / m if m > 0 else math.nan
            lines.append(
                f"| {policy} | {_fmt(m, h)} | {sim:.3f} | {ratio:.2f} | "
                f"{_mean(rs, 'hit_ratio')[0]:.2f} | {_mean(rs, 'forwarded_fraction')[0]:.2f} | "
                f"{_mean(rs, 'busiest_peer_utilization')[0]:.2f} | "
                f"{_fmt_util(_mean(rs, 'predicted_busiest_peer_utilization')[0])} | "
                + (f"{_at_run(rs):.3f} | " if again else "") + f"{len(rs)} |")
        lines.append("")
        lines += _per_entry(by_policy)
    lines += ["### The targets, point by point", "",
              "| d ms | load | cost lowest | clear of random | clear of local | "
              "within 5% of longest_prefix | predictions within 25% |",
              "|---|---|---|---|---|---|---|"]

    def yes(v: bool | None) -> str:
        return "n/a" if v is None else ("yes" if v else "**no**")

    for c in checks(rows):
        lines.append(
            f"| {c['delay_ms']:g} | {c['load']} | {yes(c['cost_lowest'])} | "
            f"{yes(c['cost_clear_of_random'])} | {yes(c['cost_clear_of_local'])} | "
            f"{yes(c['cost_within_5pct_of_longest_prefix'])} | "
            f"{yes(c['predictions_within_25pct'])} |")
    lines.append("")
    return "\n".join(lines)
