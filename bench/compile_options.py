"""The compiled decode step built two ways in one process, timed alternately: as
peer/engine/compiled_decode.py builds it (weights frozen, inductor's own matrix products
where they time faster: `new`) and as it was built before (`freezing` passed only as a
compile option, which froze nothing, and no max-autotune: `old`).

    python -m bench.compile_options --json out/compile_options.json [--model smollm2-135m]
        [--dtype int4] [--threads 2] [--context 700] [--blocks 6] [--steps 30]

Both steps run on the same model and the same KV buffer (random values: the step's time
does not depend on them), `--blocks` times each, alternating, `--steps` steps a block;
each block's figure is its median step (`old_ms`, `new_ms`), `ratios` new / old per block,
`ratio_mean` their mean. Only figures from one process compare: this machine's speed
moves by tens of percent between minutes. Whether the new build keeps the eager step's
answers is measured on real prompts elsewhere (tests/test_compiled_decode.py,
`python -m bench.greedy_gaps --compile-decode`): on random K and V the logits mean
nothing. Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from bench.step_bench import step_bench_main
from peer.engine import compiled_decode
from peer.engine.model import load_model
from peer.engine.runner import SeqKV

OLD_OPTIONS = {"freezing": True, "cpp_wrapper": True}  # the options before the fix


def log(msg: str) -> None:
    print(f"[bench.compile_options] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def old_build() -> Iterator[None]:
    """compiled_decode as it was: its options without max-autotune, nothing set globally
    while Dynamo traces (so `freezing` reached inductor only)."""
    options, settings = compiled_decode.INDUCTOR_OPTIONS, compiled_decode._compile_settings
    compiled_decode.INDUCTOR_OPTIONS = dict(OLD_OPTIONS)
    compiled_decode._compile_settings = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        compiled_decode.INDUCTOR_OPTIONS = options
        compiled_decode._compile_settings = settings


def median_step_ms(step: compiled_decode.CompiledDecode, kv: SeqKV, context: int,
                   steps: int) -> float:
    times = []
    for _ in range(steps):
        kv.length = context
        start = time.perf_counter()
        step(kv, 5)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", threads=args.threads)
    model = loaded.model
    steps: dict[str, compiled_decode.CompiledDecode] = {}
    compile_s: dict[str, float] = {}
    for name in ("old", "new"):
        with old_build() if name == "old" else contextlib.nullcontext():
            step = compiled_decode.CompiledDecode(model)
            start = time.perf_counter()
            step.compile()
        compile_s[name] = time.perf_counter() - start
        steps[name] = step
        log(f"{name}: compiled in {compile_s[name]:.1f} s")
    data = torch.randn((loaded.num_layers, 2, loaded.num_kv_heads, args.context + 200,
                        loaded.head_dim), generator=torch.Generator().manual_seed(0))
    kv = SeqKV(data.to(next(model.parameters()).dtype), args.context)
    for step in steps.values():
        median_step_ms(step, kv, args.context, 5)  # one-time costs, not counted
    old_ms: list[float] = []
    new_ms: list[float] = []
    for block in range(args.blocks):
        old_ms.append(median_step_ms(steps["old"], kv, args.context, args.steps))
        new_ms.append(median_step_ms(steps["new"], kv, args.context, args.steps))
        log(f"block {block + 1}/{args.blocks}: old {old_ms[-1]:.2f} ms, new {new_ms[-1]:.2f} "
            f"ms, new / old {new_ms[-1] / old_ms[-1]:.3f}")
    ratios = [n / o for n, o in zip(new_ms, old_ms, strict=True)]
    return {
        "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "context": args.context, "blocks": args.blocks, "steps": args.steps,
        "compile_s": compile_s, "old_ms": old_ms, "new_ms": new_ms, "ratios": ratios,
        "ratio_mean": statistics.mean(ratios),
        "compiled_steps": {name: step.steps for name, step in steps.items()},
        "load_average_1m_start": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    return step_bench_main("python -m bench.compile_options", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
