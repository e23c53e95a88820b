"""`python -m bench.testbed.cpu_split --json FILE`: where a committed testbed run's CPU
went, per peer: least squares over its rows of each peer's CPU seconds beyond its idle
self (utilisation x share x the measured window) on the requests it served from its own
clients, the forwarded ones it served, and those it forwarded as their entry; for the
measurements, and for the simulator's predictions of the same rows (`--at-run`: the
run's own, kept in `predicted_at_run`). Prints JSON: ms of CPU per request of each kind."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import emit_json
from bench.testbed.predict import forwards_per_entry, utilization_cores

KINDS = ("served_own_ms", "served_forwarded_ms", "forwarded_at_entry_ms")


def split(rows: Sequence[dict[str, Any]], cores: Sequence[float], idle: Sequence[float],
          requests: int, predicted: str | None = None) -> list[dict[str, float]]:
    """Per peer, its CPU per request of each of KINDS, measured (`predicted` None) or by
    the predictions under that key ("row": the row's own `predicted_*`, "at_run": its
    `predicted_at_run`)."""
    out = []
    for peer, (c, b) in enumerate(zip(cores, idle, strict=True)):
        x, y = [], []
        for row in rows:
            source = (row if predicted is None else
                      {k.removeprefix("predicted_"): v for k, v in
                       (row if predicted == "row" else row["predicted_at_run"]).items()
                       if k.startswith("predicted_")})
            util, matrix = source["peer_utilization"], source["served_matrix"]
            window = requests / float(row["rate_per_s"])  # the measured arrivals' span
            y.append((float(util[peer]) - b) * c * window)
            x.append([matrix[peer][peer], sum(m[peer] for i, m in enumerate(matrix) if i != peer),
                      forwards_per_entry(matrix)[peer]])
        coef = np.linalg.lstsq(np.array(x, dtype=float), np.array(y), rcond=None)[0]
        out.append({k: round(float(v) * 1e3, 1) for k, v in zip(KINDS, coef, strict=True)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.testbed.cpu_split", description=__doc__)
    p.add_argument("--json", required=True, help="a bench.testbed result")
    p.add_argument("--at-run", action="store_true",
                   help="the simulated side from the run's own predictions")
    args = p.parse_args(argv)
    result = json.loads(Path(args.json).read_text())
    params = result["params"]
    rows = [r for r in result["rows"] if r.get("served_matrix")]
    if not rows:
        raise SystemExit(f"{args.json}: no row has the per-entry matrix (runs before it)")
    cores = utilization_cores(params["shares"], bool(params.get("isolated", True)))
    idle = [float(c.get("background_cores", 0.0)) / k
            for c, k in zip(result["calibration"], cores, strict=True)]
    requests = int(params["requests"])
    emit_json({"measured": split(rows, cores, idle, requests),
               "simulated": split(rows, cores, idle, requests,
                                  "at_run" if args.at_run else "row")}, None)


if __name__ == "__main__":
    main()
