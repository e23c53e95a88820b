"""Serving regimes: which peers a simulated swarm has and how fast they serve.

A regime is a parameter set, not code: the default peer's `Calibration`, optionally a
per-peer cycle of calibrations (a heterogeneous swarm), and the delays its sweep visits.
Result rows carry the regime's name (`regime`).

* `cpu`: this project's CPU peer. Prefill is fitted (`Calibration.from_engine_json`) to
  the committed `python -m bench.engine` run on this machine,
  docs/results/bench_engine.json (SmolLM2-135M, fp32, 2 vCPUs: a 1,016-token prompt cold,
  with 496 and with 912 tokens cached); decode stays at the notes' 70 ms per token, which
  that file does not measure.
* `gpu`: an 8B model on one datacenter GPU (GPU_SOURCES below). Recomputing a 377-token
  prefix costs ~45 ms instead of ~0.6 s, so network delay and staleness weigh ~10x more.
* `mixed`: a volunteer swarm, one `gpu` peer in MIXED_GPU_EVERY, the others MIXED_SLOW_FACTOR
  times slower (consumer GPUs or many-core CPUs serving the same model).

The server is the simulator's batching engine (bench/sim/server_model.py, the engine's own
scheduler rules); a step of b decodes costs `decode_s * (1 - s + s * b)` (Calibration).
On the CPU the slope s is the cost model's, fitted to bench.engine's sweeps. On a GPU,
decode at these batch sizes is memory-bound: the one published point (batch 8, 7.8 ms a
step) is taken as the step for any batch, slope 0 -- an assumption beyond batch 8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bench.sim.calibration import NOTES_CALIBRATION, Calibration

ENGINE_JSON = Path(__file__).resolve().parents[2] / "docs" / "results" / "bench_engine.json"

# Published measurements for the `gpu` regime (Llama-3.1-8B, bf16, vLLM, tensor parallel 1):
GPU_SOURCES = (
    "vLLM performance benchmark (buildkite.com/vllm/performance-benchmark), "
    "latency_llama8B_tp1: input 32, output 128 tokens, batch 8, mean latency 997.5 ms on "
    "H100 (7.8 ms per decode step) and 833.4 ms on H200 (6.5 ms per step)",
    "prefill: 10,000 tokens/s, an assumption inside the 5,000-20,000 tokens/s range expected "
    "for this peer (compute-bound: 16 GFLOP per token of an 8B model against ~990 dense bf16 "
    "TFLOP/s of an H100 is 62,000 tokens/s at full use); no published prefill-only "
    "measurement was found",
)
GPU_CALIBRATION = Calibration(
    name="llama-3.1-8b-h100",
    prefill_fixed_s=0.0078,  # one forward pass: about a decode step
    prefill_s_per_token=1.0e-4,  # 10,000 tokens/s
    # attention: 4 * layers * d_model = 0.52 MFLOP per token per context token, against
    # 16 GFLOP per token for the weights: 3.3e-5 of the per-token cost
    prefill_s_per_token_ctx=3.3e-9,
    decode_s_per_token=0.0078,  # H100, batch 8 (the published point closest to batch 1)
    batch_step_slope=0.0,  # memory-bound decode: a batch's step as one lone step
    source="; ".join(GPU_SOURCES),
)

MIXED_GPU_EVERY = 4  # peers 0, 4, 8, ... are GPU-class
MIXED_SLOW_FACTOR = 10.0  # the other volunteers: an assumption, not a measurement


@dataclass(frozen=True)
class Regime:
    """One serving regime (see the module docstring)."""

    name: str
    calibration: Calibration
    # peer i uses peer_calibrations[i % len] when set (a heterogeneous swarm)
    peer_calibrations: tuple[Calibration, ...] = ()
    quick_delays_ms: tuple[float, ...] = (0, 5, 50, 250)
    delays_ms: tuple[float, ...] = (0, 1, 5, 20, 50, 100, 250)


def cpu_calibration() -> Calibration:
    """This machine's bench.engine run, or the notes' fit when the file is missing."""
    if not ENGINE_JSON.is_file():
        return NOTES_CALIBRATION
    fitted = Calibration.from_engine_json(ENGINE_JSON)
    return replace(fitted, name="smollm2-135m-cpu",
                   source="docs/results/bench_engine.json (python -m bench.engine, this "
                   "machine), least-squares fit; decode: the notes' 70 ms per token")


def regime(name: str) -> Regime:
    """The named regime: `cpu`, `gpu` or `mixed`."""
    if name == "cpu":
        return Regime("cpu", cpu_calibration())
    if name == "gpu":
        return Regime("gpu", GPU_CALIBRATION, quick_delays_ms=(0, 2, 5, 10, 20),
                      delays_ms=(0, 1, 2, 5, 10, 20, 50, 100))
    if name == "mixed":
        slow = GPU_CALIBRATION.scaled(MIXED_SLOW_FACTOR)
        cycle = (GPU_CALIBRATION,) + (slow,) * (MIXED_GPU_EVERY - 1)
        return Regime("mixed", GPU_CALIBRATION, peer_calibrations=cycle,
                      quick_delays_ms=(0, 2, 5, 10, 20), delays_ms=(0, 1, 2, 5, 10, 20, 50))
    raise ValueError(f"unknown regime {name!r}; known: {REGIME_NAMES}")


REGIME_NAMES = ("cpu", "gpu", "mixed")
