"""Do greedy answers survive batching and the prefix cache, per weight format, and how far
from the verifier's argmax do honest tokens sit?

    python -m bench.greedy_gaps --json PATH [--model smollm2-135m]
        [--dtypes float32,bfloat16,int8,int4] [--requests 30] [--concurrency 4] [--seed 0]
        [--compile-decode]

Per format, --requests seeded MMLU 5-shot requests (8 subjects, so prefixes repeat; 8 new
tokens each) are answered greedily three ways: one at a time on an uncached engine (the
reference), one at a time on a caching engine (prefix reuse), and --concurrency at a time
on a fresh caching engine (continuous batching and reuse). Per row:

  cached_differs, batched_differs   answers that differ from the reference
  first_difference                  per differing batched answer, its first differing token
  gap_max, gap_p99                  over every token of every cached and batched answer: how
                                    far its log-probability sits below the best token's in
                                    a teacher-forced prefill over an uncached engine, chunked
                                    as Engine.verify chunks it (the greedy check's quantity;
                                    0 where the token is the argmax)
  over_tolerance                    answers with a token past the format's greedy tolerance
                                    (`tolerance`): an honest peer the verifier
                                    would call a liar
With --compile-decode the caching engines decode a lone sequence through the compiled
step (peer/engine/compiled_decode.py) while the reference and the verifier stay eager: do
a compiled peer's answers pass an eager peer's check?
Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch
import trio

from bench.report import emit_json
from bench.stats import percentile
from bench.workloads import load_tokenized_mmlu, mmlu_requests
from peer.engine.api import SamplingParams
from peer.engine.compute_thread import compute_thread
from peer.engine.engine import Engine, load_engine
from peer.engine.model import DEFAULT_MODEL, DTYPES, load_model
from peer.engine.verify import forward_chunk, greedy_gaps, tolerance
from peer.engine.verify_plan import verify_chunks
from protocols.ids import split_model_id

NEW_TOKENS = 8


def log(msg: str) -> None:
    print(f"[bench.greedy_gaps] {msg}", file=sys.stderr, flush=True)


def answer_gaps(engine: Engine, prompt: list[int], output: list[int]) -> list[float]:
    """Worker thread: each output token's gap below the argmax, scored as the verifier
    scores it (prompt + output in the verifier's chunks on a fresh KV)."""
    full = prompt + output[:-1]
    kv = engine.runner.new_kv([], len(full))
    gaps: list[float] = []
    with torch.inference_mode():
        for new, before in verify_chunks(len(prompt), len(output), 0):
            logits, offset = forward_chunk(engine.runner, kv, full, before + new, len(prompt))
            if logits.shape[0]:
                targets = output[offset : offset + logits.shape[0]]
                gaps += greedy_gaps(logits, targets).tolist()
    return gaps


async def answers(engine: Engine, prompts: list[list[int]], concurrency: int
                  ) -> list[tuple[int, ...]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    out: list[tuple[int, ...]] = [()] * len(prompts)
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            out[i] = (await engine.generate(prompts[i], params)).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


async def measure(model: str, dtype: str, prompts: list[list[int]], concurrency: int,
                  compile_decode: bool = False) -> dict[str, Any]:
    def load(cache_bytes: int) -> Engine:
        return load_engine(model, cache_bytes, 16, dtype=dtype)

    reference_engine = await compute_thread().run(load, 0)
    reference = await answers(reference_engine, prompts, 1)
    if compile_decode:
        compiled = await compute_thread().run(
            functools.partial(load_model, model, dtype=dtype, compile_decode=True))
        cached = await answers(Engine.from_model(compiled, 10**9, 16), prompts, 1)
        batched = await answers(Engine.from_model(compiled, 10**9, 16), prompts, concurrency)
    else:
        cached = await answers(await compute_thread().run(load, 10**9), prompts, 1)
        batched = await answers(await compute_thread().run(load, 10**9), prompts,
                                concurrency)
    greedy_slack = tolerance(split_model_id(reference_engine.model_id)[1]).greedy
    all_gaps: list[float] = []
    over = 0
    for got in (cached, batched):
        for prompt, output in zip(prompts, got, strict=True):
            if not output:
                continue
            gaps = await compute_thread().run(
                answer_gaps, reference_engine, prompt, list(output)
            )
            all_gaps += gaps
            over += any(g > greedy_slack for g in gaps)

    def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        pairs = enumerate(zip(a, b, strict=False))
        return next((k for k, (x, y) in pairs if x != y), min(len(a), len(b)))

    differing = [i for i in range(len(prompts)) if batched[i] != reference[i]]
    return {
        "dtype": dtype, "model_id": reference_engine.model_id, "requests": len(prompts),
        "cached_differs": sum(c != r for c, r in zip(cached, reference, strict=True)),
        "batched_differs": len(differing),
        "first_difference": [first_difference(batched[i], reference[i]) for i in differing],
        "tokens_scored": len(all_gaps),
        "gap_max": max(all_gaps, default=0.0), "gap_p99": percentile(all_gaps, 0.99),
        "greedy_tolerance": greedy_slack, "over_tolerance": over,
        "compile_decode": compile_decode,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    requests = mmlu_requests(load_tokenized_mmlu(), args.requests, 1.0, 1.0,
                             max_new_tokens=NEW_TOKENS, seed=args.seed, subjects=8)
    prompts = [list(r.prefix + r.suffix) for r in requests]
    rows = []
    for dtype in args.dtypes:
        row = await measure(args.model, dtype, prompts, args.concurrency, args.compile_decode)
        log(f"{dtype}: {row['batched_differs']}/{row['requests']} batched and "
            f"{row['cached_differs']} cached answers differ; gap max {row['gap_max']:.3f}, "
            f"p99 {row['gap_p99']:.3f}; over the {row['greedy_tolerance']} tolerance: "
            f"{row['over_tolerance']}")
        rows.append(row)
    return {"model": args.model, "seed": args.seed, "concurrency": args.concurrency,
            "new_tokens": NEW_TOKENS, "rows": rows, "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.greedy_gaps",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int4")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-decode", action="store_true",
                   help="answer through the compiled decode step; verify eagerly")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or any(d not in DTYPES or d == "auto" for d in args.dtypes):
        p.error(f"--dtypes takes some of {[d for d in DTYPES if d != 'auto']}")
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(trio.run(functools.partial(main_async, args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
