"""Tables (Markdown) and plots (PNG, matplotlib's Agg backend) of simulator result rows."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.checks import compare_cost, hit_vs_oracle

# experiment -> (file stem, x key, x label, log x, panels as (metric key, label, log y))
PANELS: dict[str, tuple[str, str, str, bool, tuple[tuple[str, str, bool], ...]]] = {
    "delay": ("a_delay", "delay_ms", "one-way delay d (ms)", True, (
        ("ttft_mean_s", "TTFT mean (s)", False),
        ("ttft_p99_s", "TTFT p99 (s)", False),
        ("e2e_mean_s", "end-to-end mean (s)", False),
        ("hit_ratio", "prefix hit ratio", False),
    )),
    "skew": ("b_skew", "zipf_s", "Zipf exponent s of subject popularity", False, (
        ("ttft_mean_s", "TTFT mean (s)", True),
        ("ttft_p99_s", "TTFT p99 (s)", True),
        ("e2e_mean_s", "end-to-end mean (s)", True),
        ("hit_ratio", "prefix hit ratio", False),
    )),
    "load": ("c_load", "load", "offered load (x no-reuse capacity)", False, (
        ("ttft_mean_s", "TTFT mean (s)", True),
        ("e2e_mean_s", "end-to-end mean (s)", True),
        ("load_cov", "load CoV across peers", False),
        ("hit_ratio", "prefix hit ratio", False),
    )),
    "staleness": ("d_staleness", "summary_interval_s", "summary interval T (s)", True, (
        ("ttft_mean_s", "TTFT mean (s)", False),
        ("e2e_mean_s", "end-to-end mean (s)", False),
        ("hit_ratio", "prefix hit ratio", False),
    )),
    "bloom": ("e_bloom", "bloom_bits_per_entry", "Bloom bits per cache block", False, (
        ("ttft_mean_s", "TTFT mean (s)", False),
        ("hit_ratio", "prefix hit ratio", False),
        ("summary_bytes_mean", "summary size (bytes)", False),
    )),
    "scale": ("f_scale", "peers", "peers N", True, (
        ("ttft_mean_s", "TTFT mean (s)", False),
        ("hit_ratio", "prefix hit ratio", False),
        ("gossip_bytes_per_s_per_peer", "gossip bytes/s received per peer", True),
    )),
}  # fmt: skip

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("peers", "N", "{}"),
    ("delay_ms", "d ms", "{:g}"),
    ("zipf_s", "s", "{:g}"),
    ("load", "load", "{:g}"),
    ("ttft_mean_s", "TTFT mean", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99", "{:.3f}"),
    ("e2e_mean_s", "E2E mean", "{:.3f}"),
    ("e2e_p50_s", "E2E p50", "{:.3f}"),
    ("e2e_p99_s", "E2E p99", "{:.3f}"),
    ("hit_ratio", "hit", "{:.3f}"),
    ("load_cov", "load CoV", "{:.2f}"),
    ("forwarded_fraction", "fwd", "{:.2f}"),
)
EXTRA_COLUMNS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "staleness": (("summary_interval_s", "T s", "{:g}"), ("early_publish", "early", "{}"),
                  ("summaries_published", "summaries", "{:.0f}")),
    "bloom": (("bloom_bits_per_entry", "bits/entry", "{:g}"),
              ("bloom_bits", "filter bits", "{:.0f}"), ("bloom_hashes", "k", "{:.0f}"),
              ("summary_bytes_mean", "bytes", "{:.0f}")),
    "scale": (("gossip_mode", "gossip", "{}"), ("requests", "requests", "{:.0f}"),
              ("gossip_messages_per_s_per_peer", "gossip msg/s/peer", "{:.1f}"),
              ("gossip_bytes_per_s_per_peer", "gossip B/s/peer", "{:.0f}"),
              ("gossip_cpu_fraction_est", "gossip CPU (est.)", "{:.2f}")),
}  # fmt: skip


def _fmt(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return fmt.format(value)


def markdown_table(rows: Sequence[dict[str, Any]], experiment: str) -> str:
    """A Markdown table of one experiment's rows."""
    cols = TABLE_COLUMNS + EXTRA_COLUMNS.get(experiment, ())
    lines = [
        "| " + " | ".join(c[1] for c in cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    for r in rows:
        if r["experiment"] == experiment:
            lines.append("| " + " | ".join(_fmt(c[2], r.get(c[0])) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _series(rows: Sequence[dict[str, Any]], experiment: str) -> dict[str, list[dict[str, Any]]]:
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["experiment"] != experiment:
            continue
        label = r["policy"]
        if r.get("gossip_mode", "full") != "full":
            label += f" ({r['gossip_mode']} gossip)"
        if experiment == "scale" and r["requests"] < 64 * r["peers"]:
            label += f" [{int(r['requests']) // r['peers']} req/peer]"  # not a steady state
        if "early_publish" in r:
            label += "" if r["early_publish"] else " (periodic only)"
        series.setdefault(label, []).append(r)
    return series


def plot_experiment(rows: Sequence[dict[str, Any]], experiment: str, out_dir: Path,
                    title: str) -> Path | None:
    """One PNG with a panel per metric, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if experiment not in PANELS:
        return None
    stem, xkey, xlabel, logx, panels = PANELS[experiment]
    series = _series(rows, experiment)
    if not series:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, label, logy) in zip(axes, panels, strict=True):
        for name, rs in sorted(series.items()):
            pts = sorted((r[xkey], r[key]) for r in rs if r.get(xkey) is not None)
            if not pts:
                continue
            xs = [max(x, 0.5) if logx and experiment == "delay" else x for x, _ in pts]
            style = "--" if "oracle" in name else "-"
            ax.plot(xs, [y for _, y in pts], style, marker="o", ms=3, label=name)
        if logx:
            ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel + (" (0 drawn at 0.5)" if logx and experiment == "delay" else ""))
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hit_vs_oracle(
    rows: Sequence[dict[str, Any]], out_dir: Path, title: str
) -> Path | None:
    """(g): each policy's hit ratio over the oracle's, along sweeps a, b and c."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rel = hit_vs_oracle(rows)
    sweeps = [e for e in ("delay", "skew", "load") if any(r["experiment"] == e for r in rel)]
    if not sweeps:
        return None
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.6), squeeze=False)
    for ax, exp in zip(axes[0], sweeps, strict=True):
        _, xkey, xlabel, logx, _ = PANELS[exp]
        by_policy: dict[str, list[tuple[float, float]]] = {}
        for r in rel:
            if r["experiment"] == exp:
                by_policy.setdefault(r["policy"], []).append((r[xkey], r["of_oracle"]))
        for name, pts in sorted(by_policy.items()):
            pts.sort()
            xs = [max(x, 0.5) if logx else x for x, _ in pts]
            ax.plot(xs, [y for _, y in pts], marker="o", ms=3, label=name)
        ax.axhline(0.9, color="grey", lw=0.8, ls=":")
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("hit ratio / oracle's")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out_dir / "g_hit_vs_oracle.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(rows: Sequence[dict[str, Any]], out_dir: Path, caption: str) -> list[Path]:
    """Every table and plot the rows allow; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for exp, (stem, *_rest) in PANELS.items():
        if not any(r["experiment"] == exp for r in rows):
            continue
        md = out_dir / f"{stem}.md"
        md.write_text(f"# {exp}\n\n{caption}\n\n" + markdown_table(rows, exp))
        written.append(md)
        png = plot_experiment(rows, exp, out_dir, f"{exp}: {caption}")
        if png:
            written.append(png)
    rel = hit_vs_oracle(rows)
    if rel:
        lines = ["# hit ratio against the oracle\n", caption + "\n",
                 "| sweep | policy | N | d ms | s | load | hit | oracle hit | of oracle |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rel:
            lines.append(
                f"| {r['experiment']} | {r['policy']} | {r['peers']} | {r['delay_ms']:g} | "
                f"{r['zipf_s']:g} | {r['load']:g} | {r['hit_ratio']:.3f} | "
                f"{r['oracle_hit_ratio']:.3f} | {r['of_oracle']:.3f} |"
            )
        md = out_dir / "g_hit_vs_oracle.md"
        md.write_text("\n".join(lines) + "\n")
        written.append(md)
        png = plot_hit_vs_oracle(rows, out_dir, f"hit ratio vs oracle: {caption}")
        if png:
            written.append(png)
    cmp_lines = ["# cost (and cost_probe) against the best other policy\n", caption + "\n",
                 "Other = local, random, round_robin, least_loaded, longest_prefix (not the "
                 "oracle). ratio > 1.05 fails the 5% claim.\n",
                 "| policy | sweep | metric | N | d ms | s | load | value | best other | which "
                 "| ratio |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
    any_cmp = False
    for policy, metric in itertools.product(("cost", "cost_probe"),
                                            ("ttft_mean_s", "e2e_mean_s", "ttft_p99_s")):
        for c in compare_cost(rows, metric, ("delay", "skew", "load"), policy):
            any_cmp = True
            cmp_lines.append(
                f"| {policy} | {c['experiment']} | {metric} | {c['peers']} | {c['delay_ms']:g} | "
                f"{c['zipf_s']:g} | {c['load']:g} | {c['cost']:.3f} | {c['best_other']:.3f} | "
                f"{c['best_other_policy']} | {c['ratio']:.3f} |"
            )
    if any_cmp:
        md = out_dir / "cost_vs_best.md"
        md.write_text("\n".join(cmp_lines) + "\n")
        written.append(md)
    return written
