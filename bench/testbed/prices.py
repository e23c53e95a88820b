"""`python -m bench.testbed.prices --traces DIR [--policy cost]`: the router's price of
each request's chosen peer set against what the request then took, from a testbed run's
traces (`bench.testbed --traces DIR`, which keep every entry's request log and its route
reasons).

A reason states the chosen candidate's cost as network + queue + prefill + decode
(peer/routing/cost.py); the first token waits for all but the decode, so that sum is set
against the request's time to its first token. Per point and entry, three kinds: requests
kept that computed at least MISS_TOKENS prompt tokens (misses), requests kept that
computed fewer (hits), and requests forwarded. A kind priced well above what it took is a
price the router compares against others too high: for its own misses, it forwards where
it should not. Each ratio is given twice: with the whole price, and without the copy and
busy charges a reason states (what a prefill costs other requests by design, not its own
time; docs/cost-model.md). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.report import emit_json
from bench.testbed.forwards import TRACE_NAME  # a trace file's name: point, run, policy

MISS_TOKENS = 128  # prompt tokens computed from which a kept request counts as a miss
_COST = re.compile(r"cost [\d.]+ s = net (?P<net>[\d.]+) \+ queue (?P<queue>[\d.]+) "
                   r"\+ prefill (?P<prefill>[\d.]+) \+ decode [\d.]+"
                   r"(?:; (?P<charges>[\d.]+) of the prefill the copy and busy charges)?")


def priced_to_first_token(reason: str, *, charges: bool = True) -> float | None:
    """network + queue + prefill of a route reason, None where it states no cost; without
    `charges`, less the prefill's copy and busy charges it states (what the prefill costs
    other requests, not its own time)."""
    parts = _priced_parts(reason)
    if parts is None:
        return None
    price, charged = parts
    return price if charges else price - charged


def _priced_parts(reason: str) -> tuple[float, float] | None:
    """(network + queue + prefill, the charges stated within it; 0 where none)."""
    match = _COST.search(reason)
    if match is None:
        return None
    price = float(match["net"]) + float(match["queue"]) + float(match["prefill"])
    return price, float(match["charges"] or 0.0)


def kind_of(log: dict[str, Any]) -> str | None:
    """'forwarded', 'kept_miss' or 'kept_hit' for a request served on its first route step
    (one that was tried elsewhere first says little of either price), else None."""
    route = log.get("route") or []
    if log.get("outcome") != "ok" or len(route) != 1:
        return None
    if not route[0].get("local"):
        return "forwarded"
    computed = int(log["prompt_tokens"]) - int(log["cached_tokens"])
    return "kept_miss" if computed >= MISS_TOKENS else "kept_hit"


def prices(logs_by_entry: Iterable[list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
    """Per entry and kind: requests, mean price to the first token, mean TTFT, their ratio."""
    out = []
    for entry, logs in enumerate(logs_by_entry):
        seen: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for log in logs or []:
            kind = kind_of(log)
            if kind is None or not log.get("ttft_s"):
                continue
            parts = _priced_parts(log["route"][0].get("reason", ""))
            if parts is not None:
                price, charged = parts
                seen[kind].append((price, price - charged, float(log["ttft_s"])))
        for kind in ("kept_miss", "kept_hit", "forwarded"):
            triples = seen.get(kind, [])
            priced = statistics.fmean(p for p, _, _ in triples) if triples else None
            bare = statistics.fmean(b for _, b, _ in triples) if triples else None
            took = statistics.fmean(t for _, _, t in triples) if triples else None
            out.append({"entry": entry, "kind": kind, "requests": len(triples),
                        "priced_s": _rounded(priced), "ttft_s": _rounded(took),
                        "priced_over_ttft": _ratio(priced, took),
                        "priced_without_charges_over_ttft": _ratio(bare, took)})
    return out


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ratio(value: float | None, over: float | None) -> float | None:
    return round(value / over, 3) if value is not None and over else None


def prices_dir(traces: Path, policy: str) -> dict[str, list[dict[str, Any]]]:
    """`prices` per point, the runs of `policy` in `traces` pooled."""
    pooled: dict[str, list[list[dict[str, Any]]]] = {}
    for path in sorted(traces.glob(f"*_{policy}.json")):
        match = TRACE_NAME.fullmatch(path.name)
        if match is None or match["policy"] != policy:
            continue
        logs = json.loads(path.read_text()).get("request_logs") or []
        point = pooled.setdefault(match["point"], [[] for _ in logs])
        for entry, entry_logs in enumerate(logs):
            if entry < len(point):
                point[entry].extend(entry_logs or [])
    return {name: prices(logs) for name, logs in pooled.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.testbed.prices", description=__doc__)
    p.add_argument("--traces", required=True, help="a bench.testbed --traces folder")
    p.add_argument("--policy", default="cost")
    args = p.parse_args(argv)
    points = prices_dir(Path(args.traces), args.policy)
    if not points:
        raise SystemExit(f"no {args.policy} run with request logs in {args.traces}")
    emit_json({"policy": args.policy, "miss_tokens": MISS_TOKENS, "points": points}, None)


if __name__ == "__main__":
    main()
