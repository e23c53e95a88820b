"""`python -m bench.testbed.forwards --traces DIR [--policy cost] [--baseline local]`: what
the forwards of a testbed run cost their clients, from its traces (`bench.testbed
--traces DIR`): per entry peer, the requests `--policy` forwarded and their mean TTFT next
to the very same requests' under `--baseline` (the same arrivals and entries: the runs of
one point and seed share their workload), and the same for the requests it kept; per
(entry, server) pair, the forwards' count and mean TTFT. A forward that pays shows a
lower TTFT than its baseline; one that does not is the router's mistake to explain.
Prints JSON."""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import emit_json

TRACE_NAME = re.compile(r"(?P<point>.+)_run(?P<run>\d+)_(?P<policy>[a-z_]+)\.json")


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def compare(requests: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]],
            peers: int) -> dict[str, Any]:
    """One run's forwards against the baseline run of its point and seed (trace
    `requests` of each): per entry, forwarded and kept, each with its mean TTFT and the
    same requests' under the baseline; per (entry, server) pair, count and mean TTFT."""
    base = {r["index"]: r for r in baseline if r["ok"]}
    entries = []
    pairs: dict[tuple[int, int], list[float]] = defaultdict(list)
    for entry in range(peers):
        ok = [r for r in requests if r["entry"] == entry and r["ok"]]
        kinds: dict[str, Any] = {}
        for kind, chosen in (("forwarded", [r for r in ok if r["served_by"] != entry]),
                             ("kept", [r for r in ok if r["served_by"] == entry])):
            paired = [r for r in chosen if r["index"] in base]
            kinds[kind] = {
                "requests": len(chosen),
                "ttft_mean_s": _mean([r["ttft_s"] for r in paired]),
                "baseline_ttft_mean_s": _mean([base[r["index"]]["ttft_s"] for r in paired]),
                "cached_tokens_mean": _mean([r["cached_tokens"] for r in paired]),
                "baseline_cached_tokens_mean": _mean(
                    [base[r["index"]]["cached_tokens"] for r in paired]),
            }
        for r in ok:
            if r["served_by"] != entry and isinstance(r["served_by"], int):
                pairs[(entry, r["served_by"])].append(r["ttft_s"])
        entries.append({"entry": entry, **kinds})
    return {"entries": entries,
            "pairs": [{"entry": e, "server": s, "forwards": len(v), "ttft_mean_s": _mean(v)}
                      for (e, s), v in sorted(pairs.items())]}


def compare_dir(traces: Path, policy: str, baseline: str) -> list[dict[str, Any]]:
    """`compare` for every run of `policy` in `traces` that has a `baseline` run of its
    point and seed."""
    out = []
    for path in sorted(traces.glob(f"*_{policy}.json")):
        match = TRACE_NAME.fullmatch(path.name)
        if match is None or match["policy"] != policy:
            continue
        other = path.with_name(f"{match['point']}_run{match['run']}_{baseline}.json")
        if not other.is_file():
            continue
        run, base = json.loads(path.read_text()), json.loads(other.read_text())
        out.append({"point": match["point"], "run": int(match["run"]),
                    **compare(run["requests"], base["requests"], len(run["peers"]))})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.testbed.forwards", description=__doc__)
    p.add_argument("--traces", required=True, help="a bench.testbed --traces folder")
    p.add_argument("--policy", default="cost")
    p.add_argument("--baseline", default="local")
    args = p.parse_args(argv)
    runs = compare_dir(Path(args.traces), args.policy, args.baseline)
    if not runs:
        raise SystemExit(f"no {args.policy} run with a {args.baseline} run of its point and "
                         f"seed in {args.traces}")
    emit_json({"policy": args.policy, "baseline": args.baseline, "runs": runs}, None)


if __name__ == "__main__":
    main()
