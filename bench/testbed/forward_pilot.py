"""The forward pilot: `random` runs (three requests in four forwarded, from every entry)
at a rate below saturation, on the pilots' workload seeds, before the measured runs. What
the peers' CPU exceeded the simulation of the same arrivals by, per request forwarded,
the simulator then charges to every forward (predict.py `forward_cpu`): the calibration
measures a forward one request at a time in a quiet swarm, and its figure has swung from
1.3 to 22 ms of CPU by day while in the running swarm a forward took its entry 12-28 ms
(docs/testbed.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.testbed.beds import Bed
from bench.testbed.predict import (
    FORWARD_PILOT_POLICY,
    SimSetup,
    forwards_per_entry,
    utilization_cores,
    with_forward_pilot,
)
from bench.testbed.runner import run_policy, summarise
from bench.workloads import TokenRequest


async def forward_pilot(bed: Bed, setup: SimSetup,
                        workload_for: Callable[[int], Sequence[TokenRequest]],
                        seeds: Sequence[int], rate_per_s: float, model: str, delay_ms: float,
                        warmup: int) -> tuple[SimSetup, dict[str, Any]]:
    """`setup` with the forward pilot's `forward_cpu_s` (one run per seed of `seeds`, each
    sending `workload_for(seed)`, drawn at `rate_per_s`), and its record for the result,
    which bench.testbed.repredict simulates again."""
    runs, records = [], []
    for seed in seeds:
        workload = workload_for(seed)
        measured = await run_policy(bed, FORWARD_PILOT_POLICY, workload, model, seed,
                                    warmup=warmup)
        row = summarise(measured)
        forwards = forwards_per_entry(row["served_matrix"])
        runs.append((measured.utilization, forwards, workload, seed))
        records.append({"seed": seed, "ttft_mean_s": row["ttft_mean_s"],
                        "peer_utilization": [round(u, 4) for u in measured.utilization],
                        "forwards_per_entry": forwards, "failed": row["failed"]})
    setup = with_forward_pilot(setup, runs, utilization_cores(bed.shares, bed.isolated),
                               FORWARD_PILOT_POLICY, delay_ms)
    return setup, {"policy": FORWARD_PILOT_POLICY, "delay_ms": delay_ms,
                   "rate_per_s": rate_per_s, "requests": len(runs[0][2]) if runs else 0,
                   "runs": records, "forward_cpu_s": round(setup.forward_cpu_s, 5)}
