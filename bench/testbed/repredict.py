"""`python -m bench.testbed.repredict --json PATH`: the simulator's predictions of a
committed testbed run, made again by today's simulator.

A row's prediction is a function of the run's measured calibration (in the result), its
workload (drawn again from the row's seed, rate and sizes) and the simulator. When the
simulator learns something (a mechanism it did not model), the measurements stand and
the predictions can be made again without running the testbed: each row's `predicted_*`
are replaced, the run's own kept under `predicted_at_run`, and `params.repredicted` says
when and by what. Calibration terms the run did not measure take their defaults.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.report import emit_json
from bench.testbed.loads import PILOT_SEED_OFFSET
from bench.testbed.predict import (
    FORWARD_PILOT_POLICY,
    SimSetup,
    forwards_per_entry,
    idle_utilization,
    predict,
    setup_from_result,
    utilization_cores,
    with_forward_pilot,
    with_pilot_factors,
)
from bench.testbed.report import summary
from bench.testbed.workload import WorkloadSpec, run_workload
from bench.workloads import TokenizedMMLU, load_tokenized_mmlu

PREDICTED = ("predicted_ttft_mean_s", "predicted_busiest_peer_utilization", "predicted_hit_ratio",
             "predicted_served_per_peer", "predicted_peer_utilization",
             "predicted_advertised_tokens_per_s", "predicted_served_matrix",
             "predicted_hit_ratio_per_entry", "predicted_forwarded_fraction_per_entry",
             "predicted_ttft_mean_per_entry_s")


def repredict(result: dict[str, Any], data: TokenizedMMLU | None = None,
              variant: Variant | None = None) -> dict[str, Any]:
    """`result` with every row's predictions made again (in place; returned), each on
    the very arrivals its run sent (`run_workload`: the paced warm-up included) drawn
    from `data` (default: the tokenized MMLU the testbed uses), by the simulator's
    default model or `variant` of it."""
    params = result["params"]
    data = data if data is not None else load_tokenized_mmlu()
    setup = under_load(result, setup_from_result(result), data)
    if variant is not None:
        setup = replace(setup, factors_off_path=variant.factors_off_path,
                        forward_after_answer=variant.forward_after_answer)
    setup, forwards_from = with_forwards(result, setup, data)
    paces = params.get("warmup_pace") or {}  # runs before the paced warm-up have none
    for row in result["rows"]:
        row.setdefault("predicted_at_run", {k: row.get(k) for k in PREDICTED})
        workload = _sent(data, params, float(row["rate_per_s"]), int(row["seed"]),
                         float(paces.get(row["load"], 1.0)))
        pred = predict(setup, row["policy"], float(row["delay_ms"]), workload, int(row["seed"]))
        row["predicted_ttft_mean_s"] = pred.ttft_mean_s
        row["predicted_busiest_peer_utilization"] = pred.busiest_peer_utilization
        row["predicted_hit_ratio"] = pred.hit_ratio
        row["predicted_served_per_peer"] = list(pred.served_per_peer)
        row["predicted_peer_utilization"] = [round(u, 4) for u in pred.peer_utilization]
        row["predicted_advertised_tokens_per_s"] = [list(a) for a in pred.advertised]
        for key, value in pred.per_entry.items():
            row[f"predicted_{key}"] = value
    params["repredicted"] = {
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "by": "python -m bench.testbed.repredict",
        "cpu_quotas": list(setup.quotas),
        "cpu_factors": list(setup.cpu_factors),
        "forward_cpu_s": setup.forward_cpu_s,
        "forward_cpu_from": forwards_from,
        **({"variant": asdict(variant)} if variant is not None else {}),
    }
    result["summary"] = summary(result["rows"])
    return result


def _sent(data: TokenizedMMLU, params: dict[str, Any], rate: float, seed: int,
          pace: float) -> list[Any]:
    """The arrivals a run of the result sent at `rate` with `seed`, its warm-up paced."""
    warmup = int(params.get("warmup_requests", 0))
    spec = WorkloadSpec(warmup + int(params["requests"]), rate, int(params["max_new_tokens"]),
                        seed)
    return run_workload(data, spec, warmup, pace, float(params.get("warmup_pause_s", 0.0)))


def under_load(result: dict[str, Any], setup: SimSetup, data: TokenizedMMLU) -> SimSetup:
    """`setup` with the CPU factors of the run's load pilots (predict.cpu_factors), each
    pilot simulated on the very arrivals it sent (pilots are not paced); `setup` as it is
    for a run without pilots (given rates)."""
    pilots = result.get("pilots") or []
    if not pilots:
        return setup
    params = result["params"]
    seed = int(params.get("seed", 0)) + PILOT_SEED_OFFSET
    idle = idle_utilization([float(c.get("background_cores", 0.0))
                             for c in result["calibration"]], params["shares"],
                            bool(params.get("isolated", True)))
    measured = [(float(p["rate_per_s"]), [float(u) for u in p["peer_utilization"]])
                for p in pilots]
    return with_pilot_factors(setup, measured, idle,
                              lambda rate: _sent(data, params, rate, seed, 1.0),
                              str(params.get("load_policy", "local")),
                              float(params["delays_ms"][0]), seed)


@dataclass(frozen=True)
class Variant:
    """Where the simulator charges the extra CPU measured in the running swarm (the
    SimSetup flags of the same names); the default model charges the factors off the
    requests' path and the forward residual with the forward."""

    factors_off_path: bool = True
    forward_after_answer: bool = False


def with_forwards(result: dict[str, Any], setup: SimSetup, data: TokenizedMMLU
                  ) -> tuple[SimSetup, str]:
    """`setup` with the forward residual (predict.forward_cpu) of the run's forward pilot,
    simulated again on the very arrivals it sent; for a run from before the testbed ran
    one, of its own `random` rows at the first delay and the lowest load, which stand in
    for it (their own predictions are then not out of sample); and where says whence
    ("" for none: a run without per-entry rows)."""
    params = result["params"]
    usable = utilization_cores(params["shares"], bool(params.get("isolated", True)))
    pilot = result.get("forward_pilot")
    if pilot:
        runs = [(run["peer_utilization"], run["forwards_per_entry"],
                 _sent(data, params, float(pilot["rate_per_s"]), int(run["seed"]), 1.0),
                 int(run["seed"])) for run in pilot["runs"]]
        return (with_forward_pilot(setup, runs, usable, str(pilot["policy"]),
                                   float(pilot["delay_ms"])),
                f"the forward pilot, {len(runs)} runs")
    rows = [r for r in result["rows"]
            if r["policy"] == FORWARD_PILOT_POLICY and r.get("served_matrix")]
    if not rows:
        return setup, ""
    delay = float((params.get("delays_ms") or [min(float(r["delay_ms"]) for r in rows)])[0])
    loads = params.get("loads") or {}
    rows = [r for r in rows if float(r["delay_ms"]) == delay]
    if not rows:
        return setup, ""
    low = min({r["load"] for r in rows}, key=lambda load: loads.get(load, 0.0))
    paces = params.get("warmup_pace") or {}
    runs = [(r["peer_utilization"], forwards_per_entry(r["served_matrix"]),
             _sent(data, params, float(r["rate_per_s"]), int(r["seed"]),
                   float(paces.get(low, 1.0))), int(r["seed"]))
            for r in rows if r["load"] == low]
    return (with_forward_pilot(setup, runs, usable, FORWARD_PILOT_POLICY, delay),
            f"rows: {FORWARD_PILOT_POLICY}, d = {delay:g} ms, {low}, {len(runs)} runs")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.testbed.repredict", description=__doc__)
    p.add_argument("--json", required=True, help="a bench.testbed result, rewritten in place")
    p.add_argument("--out", help="write the result here instead (the input is left as it is)")
    p.add_argument("--factors-on-path", action="store_true",
                   help="charge the pilots' CPU factors on its requests' path (every cost "
                        "scaled) instead of after each step")
    p.add_argument("--forward-after-answer", action="store_true",
                   help="charge the forward pilot's residual once each answer is back, off "
                        "the request's path, instead of with the forward")
    args = p.parse_args(argv)
    path = Path(args.json)
    variant = (Variant(not args.factors_on_path, args.forward_after_answer)
               if args.factors_on_path or args.forward_after_answer else None)
    result = repredict(json.loads(path.read_text()), variant=variant)
    Path(args.out or path).write_text(json.dumps(result, indent=2) + "\n")
    emit_json({"summary": result["summary"], "repredicted": result["params"]["repredicted"]},
              None)


if __name__ == "__main__":
    main()
