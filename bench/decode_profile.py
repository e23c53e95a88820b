"""Where a decode step's time goes, per weight format: the engine's own packed forward
(peer/engine/runner.py) decoding one token per sequence after a prompt, timed, then
profiled with torch.profiler and split by op category.

    python -m bench.decode_profile --json out/decode_profile.json [--model smollm2-135m]
        [--dtypes float32,bfloat16,int8,int4] [--threads 2] [--context 400] [--steps 16]
        [--batch 8] [--prefill-tokens 1000] [--attention auto|sdpa|fixed]

Per format: `step_ms` (median wall time of one decode step of --batch sequences, each
after --context prompt tokens), `decode_tokens_per_s` (--batch / step), `step_cpu_ms`
(the process's CPU time per step: with --threads 1 the work itself, which other jobs on
a shared machine inflate far less than the wall time), and
`profile_ms_per_step` by category, from the profiler's top-level ops of the calling
thread (an op's children, and the intra-op threads it waits for, count within it):
  linear     nn.Linear and the quantized layers' kernels (aten::linear, mm, addmm, the
             int8/int4 weight-only matmuls, oneDNN's laid-out bfloat16 product)
  attention  aten::scaled_dot_product_attention, or the fixed-order attention's labelled
             span (peer/engine/runner.py; its KV writes and Python inside it)
  other_ops  every other top-level op (norms, rotary, activations, copies, cat, argmax)
  python     the step's wall time less all top-level ops: the module stack, the runner's
             packing and bookkeeping, the profiler's own cost (so an upper bound)
`batch_N`: the same timing for decode steps of --batch sequences together (their
aggregate tokens/s). `prefill_*`: a cold --prefill-tokens prompt read in the engine's
step-sized chunks (256 tokens), wall and CPU time.
Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.report import emit_json
from peer.engine.api import ATTENTIONS
from peer.engine.kv import KVLayout
from peer.engine.model import DEFAULT_MODEL, DTYPES, LoadedModel, load_model
from peer.engine.runner import FIXED_ATTENTION_LABEL, Runner
from peer.engine.scheduler import DEFAULT_STEP_TOKENS

LINEAR_OPS = frozenset({
    "aten::linear", "aten::mm", "aten::addmm", "aten::matmul",
    "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
    "mkldnn::_linear_pointwise",  # a bfloat16 layer laid out for oneDNN (peer/engine/packed.py)
})
# the fixed-order attention's label spans its whole registered function, KV writes and
# its Python included (SDPA's op is the kernel alone)
ATTENTION_OPS = frozenset({"aten::scaled_dot_product_attention", FIXED_ATTENTION_LABEL})
CATEGORIES = ("linear", "attention", "other_ops", "python")


def log(msg: str) -> None:
    print(f"[bench.decode_profile] {msg}", file=sys.stderr, flush=True)


def category(op_name: str) -> str:
    """The category of a top-level op's name."""
    if op_name in LINEAR_OPS:
        return "linear"
    if op_name in ATTENTION_OPS:
        return "attention"
    return "other_ops"


def make_runner(loaded: LoadedModel) -> Runner:
    itemsize = next(loaded.model.parameters()).element_size()
    layout = KVLayout(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, 16, itemsize)
    return Runner(loaded.model, layout)


def prefill(loaded: LoadedModel, tokens: int) -> dict[str, Any]:
    """A cold prompt of `tokens` tokens read in the engine's step-sized chunks: wall and
    CPU seconds, tokens/s (the best of two, the first paying one-time costs)."""
    runner = make_runner(loaded)
    prompt = [(100 + 7 * i) % loaded.vocab_size for i in range(tokens)]
    best = (float("inf"), float("inf"))
    for _ in range(2):
        kv = runner.new_kv([], tokens + 1)
        start, cpu_start = time.perf_counter(), time.process_time()
        for at in range(0, tokens, DEFAULT_STEP_TOKENS):
            chunk = prompt[at : at + DEFAULT_STEP_TOKENS]
            runner.forward([(kv, chunk)], [int(at + len(chunk) == tokens)])
        best = min(best, (time.perf_counter() - start, time.process_time() - cpu_start))
    return {"prefill_tokens": tokens, "prefill_s": best[0], "prefill_cpu_s": best[1],
            "prefill_tokens_per_s": tokens / best[0],
            "prefill_tokens_per_cpu_s": tokens / best[1]}


def measure(loaded: LoadedModel, context: int, steps: int, batch: int,
            profiled: bool = True) -> dict[str, Any]:
    """Decode `steps` tokens on `batch` sequences after `context` prompt tokens each:
    step times, then (if `profiled`) a profiled stretch of the same steps."""
    runner = make_runner(loaded)
    seqs = []
    for b in range(batch):
        kv = runner.new_kv([], context + 2 * steps + 4)
        prompt = [(100 + 7 * i + 13 * b) % loaded.vocab_size for i in range(context)]
        logits = runner.forward([(kv, prompt)], [1])
        seqs.append((kv, int(logits[0].argmax())))

    def step() -> None:
        logits = runner.forward([(kv, [tok]) for kv, tok in seqs], [1] * len(seqs))
        nxt = logits.argmax(dim=-1).tolist()
        seqs[:] = [(kv, int(t)) for (kv, _), t in zip(seqs, nxt, strict=True)]

    step()  # one-time costs
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    step_s = statistics.median(times)
    timed = {
        "step_ms": step_s * 1000,
        "step_ms_samples": [t * 1000 for t in times],
        "step_cpu_ms": statistics.median(cpu_times) * 1000,
        "decode_tokens_per_s": batch / step_s,
        "decode_tokens_per_cpu_s": batch / statistics.median(cpu_times),
    }
    if not profiled:
        return timed
    profiled_steps = max(2, steps // 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(profiled_steps):
            step()
        wall = time.perf_counter() - start
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    top: dict[str, float] = {}
    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        us = float(event.cpu_time_total)
        by_cat[category(event.name)] += us
        top[event.name] = top.get(event.name, 0.0) + us
    by_cat["python"] = max(0.0, wall * 1e6 - sum(by_cat.values()))
    per_step = {k: v / 1000 / profiled_steps for k, v in by_cat.items()}
    return {
        **timed,
        "profiled_step_ms": wall * 1000 / profiled_steps,
        "profile_ms_per_step": per_step,
        "profile_share": {k: v / sum(per_step.values()) for k, v in per_step.items()},
        "top_ops_ms_per_step": dict(sorted(
            ((k, v / 1000 / profiled_steps) for k, v in top.items()),
            key=lambda kv: -kv[1])[:8]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decode_profile", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16,int8,int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default="auto", choices=ATTENTIONS,
                        help="the attention kernel (auto: fixed in int8 and int4)")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8,
                        help="also time decode steps of this many sequences (0: not)")
    parser.add_argument("--prefill-tokens", type=int, default=1000,
                        help="also time a cold prompt of this many tokens (0: not)")
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes takes some of {DTYPES}")
    if min(args.threads, args.context, args.steps) < 1 or min(args.batch,
                                                              args.prefill_tokens) < 0:
        parser.error("--threads, --context, --steps must be >= 1, --batch and "
                     "--prefill-tokens >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {
        "model": args.model, "threads": args.threads, "context": args.context,
        "steps": args.steps, "batch": args.batch, "prefill_tokens": args.prefill_tokens,
        "by_dtype": {},
    }
    for dtype in dtypes:
        loaded = load_model(args.model, dtype=dtype, device="cpu", threads=args.threads,
                            attention=args.attention)
        with torch.inference_mode():
            r = measure(loaded, args.context, args.steps, 1)
            if args.batch:
                r[f"batch_{args.batch}"] = measure(loaded, args.context, args.steps,
                                                   args.batch, profiled=False)
            if args.prefill_tokens:
                r.update(prefill(loaded, args.prefill_tokens))
        r["model_id"] = loaded.model_id
        r["attention"] = loaded.attention
        out["by_dtype"][dtype] = r
        cats = ", ".join(f"{k} {v:.1f}" for k, v in r["profile_ms_per_step"].items())
        log(f"{dtype}: {r['step_ms']:.1f} ms/step ({r['step_cpu_ms']:.1f} ms CPU), "
            f"{r['decode_tokens_per_s']:.1f} tokens/s; "
            f"profiled ms/step: {cats} (load {os.getloadavg()[0]:.1f})")
        del loaded
    out.update(load_average_1m_start=load_before, load_average_1m_end=os.getloadavg()[0],
               cpus=os.cpu_count(), torch=torch.__version__,
               cpu_capability=torch.backends.cpu.get_cpu_capability())
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
