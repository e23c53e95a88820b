"""The compiled decode step timed on the process's compute thread and on other threads, in
one process, alternating blocks: what running torch on more than one thread costs.

    python -m bench.compute_thread --json out/compute_thread.json [--model smollm2-135m]
        [--dtype int4] [--threads 2] [--context 700] [--blocks 6] [--steps 30]

The model is loaded and its decode step compiled on the compute thread
(peer/engine/compute_thread.py). Each block then times --steps steps on the compute thread
(`compute_ms`) and --steps on a thread started for the block and ended after it
(`other_ms`, what trio.to_thread's pooled workers gave the engine before), and finally on
the compute thread once more while the other thread is still alive (`compute_beside_ms`:
a second OpenMP team exists). Each figure is a block's median step; `ratios` other /
compute per block, `ratio_mean` their mean; `context_switches_per_step` the process's
context switches per step in each case (libgomp's workers sleeping on a futex between
parallel regions show here). Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.step_bench import step_bench_main
from peer.engine.compiled_decode import CompiledDecode
from peer.engine.compute_thread import compute_thread
from peer.engine.model import load_model
from peer.engine.runner import SeqKV


def log(msg: str) -> None:
    print(f"[bench.compute_thread] {msg}", file=sys.stderr, flush=True)


def _switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def timed_block(step: CompiledDecode, kv: SeqKV, context: int, steps: int, threads: int
                ) -> tuple[float, float]:
    """Median ms of `steps` steps at `context` tokens, and context switches per step."""
    torch.set_num_threads(threads)  # OpenMP's count is per thread
    times = []
    before = _switches()
    for _ in range(steps):
        kv.length = context
        start = time.perf_counter()
        step(kv, 5)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), (_switches() - before) / steps


def on_new_thread(fn: Callable[[], Any]) -> Any:
    """fn() on a thread started for it and ended after it."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


@contextlib.contextmanager
def second_team() -> Iterator[None]:
    """Another thread that has run one parallel torch op, alive until the block ends."""
    ran, leave = threading.Event(), threading.Event()

    def body() -> None:
        torch.ones(1 << 22).sum()  # parallel: this thread gets an OpenMP team
        ran.set()
        leave.wait()

    thread = threading.Thread(target=body)
    thread.start()
    ran.wait()
    try:
        yield
    finally:
        leave.set()
        thread.join()


def run(args: argparse.Namespace) -> dict[str, Any]:
    compute = compute_thread()

    def build() -> tuple[CompiledDecode, SeqKV]:
        loaded = load_model(args.model, dtype=args.dtype, device="cpu", threads=args.threads)
        step = CompiledDecode(loaded.model)
        seconds = step.compile()
        log(f"compiled in {seconds:.1f} s")
        data = torch.randn((loaded.num_layers, 2, loaded.num_kv_heads, args.context + 200,
                            loaded.head_dim), generator=torch.Generator().manual_seed(0))
        return step, SeqKV(data.to(next(loaded.model.parameters()).dtype), args.context)

    step, kv = compute.call(build)

    def block() -> tuple[float, float]:
        return timed_block(step, kv, args.context, args.steps, args.threads)

    compute.call(block)  # one-time costs, not counted
    rows: dict[str, list[float]] = {k: [] for k in (
        "compute_ms", "other_ms", "compute_beside_ms",
        "compute_switches", "other_switches", "compute_beside_switches")}
    for i in range(args.blocks):
        ms, sw = compute.call(block)
        rows["compute_ms"].append(ms)
        rows["compute_switches"].append(sw)
        ms, sw = on_new_thread(block)
        rows["other_ms"].append(ms)
        rows["other_switches"].append(sw)
        with second_team():
            ms, sw = compute.call(block)
        rows["compute_beside_ms"].append(ms)
        rows["compute_beside_switches"].append(sw)
        log(f"block {i + 1}/{args.blocks}: compute thread {rows['compute_ms'][-1]:.2f} ms, "
            f"another thread {rows['other_ms'][-1]:.2f} ms, compute thread beside a second "
            f"team {ms:.2f} ms")
    ratios = [o / c for o, c in zip(rows["other_ms"], rows["compute_ms"], strict=True)]
    return {
        "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "context": args.context, "blocks": args.blocks, "steps": args.steps,
        "compute_ms": rows["compute_ms"], "other_ms": rows["other_ms"],
        "compute_beside_ms": rows["compute_beside_ms"],
        "ratios": ratios, "ratio_mean": statistics.mean(ratios),
        "context_switches_per_step": {
            "compute": statistics.mean(rows["compute_switches"]),
            "other": statistics.mean(rows["other_switches"]),
            "compute_beside": statistics.mean(rows["compute_beside_switches"]),
        },
        "load_average_1m_start": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    return step_bench_main("python -m bench.compute_thread", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
