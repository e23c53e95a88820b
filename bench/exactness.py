"""Where the engine's greedy answers stop being transformers' own, one cause at a time.

    python -m bench.exactness --json out/exactness.json [--model smollm2-135m]
        [--dtypes int4,int8,bfloat16] [--prompts 16] [--new-tokens 32] [--threads 2]
        [--attention auto|sdpa|fixed]

bench.engine's `outputs_identical_batched` compares the engine's batched answers with
plain `generate` on the same loaded model. This bench separates the causes, per
format (bit for bit, on random inputs at the model's own shapes where not said):
  linear_rows_differing     a projection of the model (layer 0's gate_proj) applied to
                            --rows rows at once, then in calls of m rows: rows that
                            differ, per m
  attention_rows_differing  torch's SDPA: rows of a causal whole-prompt call computed
                            again in calls of m query rows over the same keys (a prompt
                            read in chunks, or after cached tokens), and alone over
                            exactly their own keys (a decode): rows that differ, per
                            prompt length and m
  fixed_attention_rows_differing  the same for peer/engine/fixed_attention.py's kernel
  engine_identical          answers equal to `generate` among --prompts MMLU prompts,
                            served 8 at a time: whole prompts and no prefix cache
                            (batching alone), prompts read in chunks of 256 tokens and no
                            cache, and the default engine (chunks and prefix reuse)
Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import trio

from bench.engine import sweep_prompts, transformers_sequential
from bench.report import emit_json
from peer.engine.api import ATTENTIONS
from peer.engine.compute_thread import compute_thread
from peer.engine.engine import Engine, SamplingParams
from peer.engine.fixed_attention import fixed_order_attention
from peer.engine.model import DEFAULT_MODEL, DTYPES, LoadedModel, load_model
from peer.engine.scheduler import DEFAULT_STEP_TOKENS

CALL_ROWS = (1, 2, 8, 32, 33, 64, 256)
PROMPT_LENGTHS = (401, 900)
WHOLE_PROMPTS = 1 << 16  # a step budget no prompt here reaches: never read in chunks
CONCURRENCY = 8


def log(msg: str) -> None:
    print(f"[bench.exactness] {msg}", file=sys.stderr, flush=True)


def _activations(loaded: LoadedModel) -> torch.dtype:
    """The dtype the model computes in: its parameters' (bfloat16 in int4 and int8, whose
    quantized weights are buffers)."""
    return next(loaded.model.parameters()).dtype


def linear_rows_differing(loaded: LoadedModel, rows: int) -> dict[str, int]:
    """Rows of layer 0's gate projection that differ between one call over `rows` rows
    and calls of m rows, per m."""
    proj = loaded.model.model.layers[0].mlp.gate_proj
    x = torch.randn(1, rows, loaded.model.config.hidden_size, generator=torch.Generator()
                    .manual_seed(0)).to(_activations(loaded))
    with torch.inference_mode():
        whole = proj(x)[0]
        out = {}
        for m in CALL_ROWS:
            parts = torch.cat([proj(x[:, i : i + m])[0] for i in range(0, rows, m)])
            out[str(m)] = int((parts != whole).any(dim=-1).sum())
    return out


def attention_rows_differing(loaded: LoadedModel, kernel: str) -> dict[str, dict[str, int]]:
    """Per prompt length: rows of a causal call of `kernel` (sdpa: torch's SDPA; fixed:
    peer/engine/fixed_attention.py) over the whole prompt that differ when computed in
    calls of m query rows over the same keys (`chunks_of_m`), and alone over exactly their
    own keys (`alone`), at the model's heads and head size."""
    config = loaded.model.config
    heads = config.num_attention_heads
    head_dim = loaded.head_dim
    dtype = _activations(loaded)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    scale = head_dim**-0.5

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int) -> torch.Tensor:
        """Rows first.. of q over keys k ([1, heads, n, head_dim]): causal from `first`."""
        if kernel == "fixed":
            return fixed_order_attention(q, k, v, scale, offset=first).transpose(1, 2)
        n, length = q.shape[2], k.shape[2]
        if first == 0 and n == length:
            return sdpa(q, k, v, is_causal=True)
        mask = torch.arange(length)[None, :] <= torch.arange(first, first + n)[:, None]
        return sdpa(q, k, v, attn_mask=mask[None, None])

    gen = torch.Generator().manual_seed(1)
    out: dict[str, dict[str, int]] = {}
    with torch.inference_mode():
        for length in PROMPT_LENGTHS:
            q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen).to(dtype)
                       for _ in range(3))
            whole = attend(q, k, v, 0)
            counts = {}
            for m in CALL_ROWS:
                differ = 0
                for start in range(0, length, m):
                    end = min(start + m, length)
                    part = attend(q[:, :, start:end], k, v, start)
                    differ += int((part != whole[:, :, start:end]).any(dim=-1).any(dim=1).sum())
                counts[f"chunks_of_{m}"] = differ
            alone = [attend(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], i)
                     for i in range(length)]
            counts["alone"] = int((torch.cat(alone, dim=2) != whole)
                                  .any(dim=-1).any(dim=1).sum())
            out[str(length)] = counts
    return out


async def engine_identical(loaded: LoadedModel, prompts: list[list[int]],
                           reference: list[list[int]], new_tokens: int) -> dict[str, int]:
    """Answers equal to `reference` at CONCURRENCY requests at a time, per engine setup."""
    setups = {
        "whole_prompts_no_cache": dict(cache_bytes=0, step_tokens=WHOLE_PROMPTS),
        "chunks_no_cache": dict(cache_bytes=0, step_tokens=DEFAULT_STEP_TOKENS),
        "default": {},
    }
    out = {}
    for name, settings in setups.items():
        engine = Engine.from_model(loaded, **settings)  # type: ignore[arg-type]
        answers: list[list[int]] = [[] for _ in prompts]
        todo = iter(range(len(prompts)))

        async def client(engine: Engine = engine, answers: list[list[int]] = answers,
                         todo: Iterator[int] = todo) -> None:
            for i in todo:
                done = await engine.generate(prompts[i], SamplingParams(max_new_tokens=new_tokens))
                answers[i] = list(done.token_ids)

        async with trio.open_nursery() as nursery:
            for _ in range(CONCURRENCY):
                nursery.start_soon(client)
        out[name] = sum(a == r for a, r in zip(answers, reference, strict=True))
        log(f"  engine, {name}: {out[name]} of {len(prompts)} answers identical")
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    by_format: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        log(f"{dtype}: loading {args.model}")
        loaded = await compute_thread().run(
            lambda dtype=dtype: load_model(args.model, dtype=dtype, threads=args.threads,
                                           attention=args.attention))
        linear = await compute_thread().run(linear_rows_differing, loaded, args.rows)
        log(f"  linear rows differing by call size: {linear}")
        attention = await compute_thread().run(attention_rows_differing, loaded, "sdpa")
        log(f"  SDPA rows differing: {attention}")
        fixed = await compute_thread().run(attention_rows_differing, loaded, "fixed")
        log(f"  fixed-order attention rows differing: {fixed}")
        per_subject = -(-args.prompts // 4)
        prompts = [p for _, p in sweep_prompts(loaded, 400, 4, per_subject)][: args.prompts]
        _, reference = await compute_thread().run(
            transformers_sequential, loaded, prompts, args.new_tokens)
        engine = await engine_identical(loaded, prompts, reference, args.new_tokens)
        by_format[dtype] = {"linear_rows_differing": linear,
                            "attention_rows_differing": attention,
                            "fixed_attention_rows_differing": fixed,
                            "engine_attention": loaded.attention,
                            "engine_identical": engine}
    return {
        "model": args.model, "threads": args.threads, "rows": args.rows,
        "prompts": args.prompts, "new_tokens": args.new_tokens,
        "concurrency": CONCURRENCY, "torch": torch.__version__,
        "by_format": by_format,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exactness",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="int4,int8,bfloat16",
                        help=f"comma-separated, of {', '.join(d for d in DTYPES if d != 'auto')}")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=512, help="rows of the projection check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default="auto", choices=ATTENTIONS,
                        help="the engine's attention kernel (auto: fixed in int8 and int4)")
    args = parser.parse_args(argv)
    bad = [d for d in args.dtypes.split(",") if d not in DTYPES or d == "auto"]
    if bad:
        parser.error(f"unknown formats {bad}")
    if min(args.prompts, args.new_tokens, args.rows, args.threads) < 1:
        parser.error("--prompts, --new-tokens, --rows and --threads must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(trio.run(run, args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
