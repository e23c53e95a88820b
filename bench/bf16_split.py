"""Where bfloat16 greedy outputs part from transformers' (docs/engine.md, "bfloat16").

    python -m bench.bf16_split --json PATH [--dtype bfloat16] [--new-tokens 32]

On the 16 prompts of bench.engine's sweep, one at a time (concurrency 1), 32 greedy tokens
each from seven paths, and how many of the 16 outputs each pair has in common:
  ref                    transformers `generate`, the prompt read in one forward
  ref_prefix256 / 336    `generate` after transformers itself read the first 256 / 336
                         tokens into a DynamicCache (the prompt read in two pieces)
  eng_one_chunk_nocache  our engine, no prefix cache, step budget above the prompt (one piece)
  eng_chunk256_nocache   our engine, no prefix cache, 256-token steps (the default)
  eng_c1_cached          our engine as the sweep runs it at c = 1 (cache and 256-token steps)
  eng_one_chunk_cached   cache on, step budget above the prompt (cached prefix + one piece)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio
from transformers import DynamicCache

from bench.engine import sweep_prompts
from bench.report import emit_json
from peer.engine.engine import Engine, SamplingParams
from peer.engine.model import DTYPES, LoadedModel, load_model

ONE_PIECE = 4096  # a step budget above every sweep prompt


def reference(loaded: LoadedModel, prompt: list[int], new: int, prefix: int = 0) -> list[int]:
    model = loaded.model
    ids = torch.tensor([prompt])
    kwargs: dict[str, Any] = {}
    with torch.inference_mode():
        if prefix:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
            kwargs["cache"] = cache
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            **kwargs,
        )
    return list(out[0, len(prompt) :].tolist())


async def engine_outputs(
    loaded: LoadedModel, prompts: list[list[int]], new: int, step_tokens: int, cached: bool
) -> tuple[list[list[int]], list[int]]:
    cache_bytes = 1 << 30 if cached else 0
    shared = Engine.from_model(loaded, cache_bytes=cache_bytes, step_tokens=step_tokens)
    outs, hits = [], []
    for p in prompts:
        engine = (
            shared if cached else Engine.from_model(loaded, cache_bytes=0, step_tokens=step_tokens)
        )
        done = await engine.generate(p, SamplingParams(max_new_tokens=new))
        outs.append(list(done.token_ids))
        hits.append(done.usage.cached_tokens)
    return outs, hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bf16_split")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    loaded = load_model("smollm2-135m", dtype=args.dtype, threads=args.threads)
    prompts = [p for _, p in sweep_prompts(loaded, 400, 4, 4)]
    n = args.new_tokens
    res: dict[str, list[list[int]]] = {
        "ref": [reference(loaded, p, n) for p in prompts],
        "ref_prefix256": [reference(loaded, p, n, 256) for p in prompts],
        "ref_prefix336": [reference(loaded, p, n, 336) for p in prompts],
    }
    runs = {
        "eng_one_chunk_nocache": (ONE_PIECE, False),
        "eng_chunk256_nocache": (256, False),
        "eng_c1_cached": (256, True),
        "eng_one_chunk_cached": (ONE_PIECE, True),
    }
    cached: list[int] = []
    for name, (step, use_cache) in runs.items():
        res[name], hits = trio.run(engine_outputs, loaded, prompts, n, step, use_cache)
        cached = hits if use_cache else cached
    names = list(res)
    emit_json(
        {
            "dtype": args.dtype,
            "prompts": len(prompts),
            "new_tokens": n,
            "cached_tokens": cached,
            "identical_to": {
                a: {
                    b: sum(x == y for x, y in zip(res[a], res[b], strict=True))
                    for b in names
                    if b != a
                }
                for a in names
            },
            "outputs": res,
            "wall_s": time.perf_counter() - start,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
