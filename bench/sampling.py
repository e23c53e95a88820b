"""Seeded sampling measured: do honest peers agree on the token each seed selects, and how
much room does the verifier leave a steerer?

    python -m bench.sampling --json PATH [--model smollm2-135m]
        [--dtypes float32,bfloat16,int8] [--answers 6] [--answer-tokens 24]
        [--prompt-tokens 256]

Per dtype and setting (temperature 1.0 / top_p 1.0, and 0.7 / 0.9), --answers sampled
answers to an MMLU 5-shot prompt (one seed each) are generated twice: each alone on an
uncached engine (a batch of one, the prompt in one step), and all at once on a batching
engine (prefill in 64-token chunks beside the others' decodes). A verifier re-scores every
answer by one teacher-forced prefill, as Engine.verify does. Per row:

  batch_identical_answers   answers equal under both batch shapes
  batch_token_agreement     tokens equal between the shapes, up to each answer's first
                            difference (after it the contexts differ)
  exact_agreement           honest tokens that the verifier's own logits select too
  gap_max, gap_p99          how far below the best perturbed score honest tokens sit in the
                            verifier's logits (logit units; `tolerance`: verify.tolerance's)
  honest_accepted           honest answers the check accepts as a whole
  accepted_tokens_mean      tokens per position the seeded check accepts (a steerer's
                            choice; 1 is the seed's own)
  unseeded_accepted_fraction_mean   the old nucleus check's accepted share of the
                            vocabulary per position, for comparison
  steer_false_accept        of positions where a plausible steered token (the most likely
                            one, or a draw with the steerer's own seed) differs from the
                            seed's, the share the check accepts

bfloat16 on a CPU without native bf16 is emulated (slow); the JSON says which CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

from bench.engine import pick_prompt
from bench.report import emit_json
from bench.verify import machine
from peer.engine.compute_thread import compute_thread
from peer.engine.engine import Engine, SamplingParams
from peer.engine.model import DEFAULT_MODEL, LoadedModel, load_model
from peer.engine.sampling import sample_seeded
from peer.engine.verify import accepted_fraction, seeded_gaps, tolerance
from protocols.ids import split_model_id

SETTINGS = ((1.0, 1.0), (0.7, 0.9))
CHUNK_TOKENS = 64  # the batching engine's step budget: prompts are read in chunks
STEERER_SEED_OFFSET = 1 << 40  # the steerer's own seed: not the one it was given


def log(msg: str) -> None:
    print(f"[bench.sampling] {msg}", file=sys.stderr, flush=True)


async def answers_both_ways(
    loaded: LoadedModel, tokens: list[int], params: list[SamplingParams]
) -> tuple[list[list[int]], list[list[int]]]:
    """Each answer alone on an uncached engine, then all at once on a batching one."""
    alone = []
    for p in params:
        done = await Engine.from_model(loaded, cache_bytes=0).generate(tokens, p)
        alone.append(list(done.token_ids))
    batched: dict[int, list[int]] = {}
    engine = Engine.from_model(loaded, step_tokens=CHUNK_TOKENS, max_running=len(params))

    async def one(i: int) -> None:
        batched[i] = list((await engine.generate(tokens, params[i])).token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(params)):
            nursery.start_soon(one, i)
    return alone, [batched[i] for i in range(len(params))]


def rescore(loaded: LoadedModel, tokens: list[int], answer: list[int]) -> torch.Tensor:
    """The verifier's logits for every answer position: one prefill of prompt + answer."""
    runner = Engine.from_model(loaded, cache_bytes=0).runner
    kv = runner.new_kv([], len(tokens) + len(answer))
    return runner.forward([(kv, tokens + answer[:-1])], [len(answer)])


def score_answers(
    loaded: LoadedModel, tokens: list[int], answers: list[list[int]],
    params: list[SamplingParams],
) -> dict[str, Any]:
    gaps: list[float] = []
    exact = 0
    accepted_counts: list[float] = []
    unseeded: list[float] = []
    steered = steered_accepted = honest_ok = 0
    slack = tolerance(split_model_id(loaded.model_id)[1]).seeded
    for answer, p in zip(answers, params, strict=True):
        logits = rescore(loaded, tokens, answer)
        row_gaps, chosen = seeded_gaps(logits, p, len(tokens))
        exact += int((chosen == torch.tensor(answer)).sum())
        target = torch.tensor(answer)[:, None]
        token_gaps = row_gaps.gather(1, target)[:, 0]
        gaps.extend(float(g) for g in token_gaps)
        honest_ok += bool((token_gaps <= slack).all())
        accepted_counts.extend((row_gaps <= slack).sum(dim=-1).tolist())
        plain = dataclasses.replace(p, seed=None)
        unseeded.extend(accepted_fraction(logits, plain).tolist())
        for r, honest in enumerate(answer):
            assert p.seed is not None
            own = sample_seeded(logits[r], p.temperature, p.top_p,
                                p.seed + STEERER_SEED_OFFSET, len(tokens) + r)
            for choice in {int(logits[r].argmax()), own} - {honest}:
                steered += 1
                steered_accepted += float(row_gaps[r, choice]) <= slack
    finite = sorted(g for g in gaps if g != float("inf"))
    return {
        "tolerance": slack,
        "positions": len(gaps),
        "exact_agreement": exact / len(gaps),
        "gap_max": max(gaps),
        "gap_p99": finite[min(len(finite) - 1, int(0.99 * len(finite)))] if finite else None,
        "honest_accepted": honest_ok / len(answers),
        "accepted_tokens_mean": statistics.fmean(accepted_counts),
        "unseeded_accepted_fraction_mean": statistics.fmean(unseeded),
        "steered_positions": steered,
        "steer_false_accept": steered_accepted / steered if steered else None,
    }


def agreement(alone: list[list[int]], batched: list[list[int]]) -> dict[str, Any]:
    same = compared = 0
    for a, b in zip(alone, batched, strict=True):
        for x, y in zip(a, b, strict=False):
            compared += 1
            if x != y:
                break
            same += 1
    return {
        "batch_identical_answers": sum(a == b for a, b in zip(alone, batched, strict=True)),
        "batch_token_agreement": same / compared if compared else None,
    }


async def one_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    loaded = await compute_thread().run(lambda: load_model(args.model, dtype=dtype))
    _, tokens, _ = pick_prompt(loaded, args.prompt_tokens)
    out: dict[str, Any] = {"prompt_tokens": len(tokens)}
    for temperature, top_p in SETTINGS:
        params = [SamplingParams(max_new_tokens=args.answer_tokens, temperature=temperature,
                                 top_p=top_p, seed=1000 + i) for i in range(args.answers)]
        alone, batched = await answers_both_ways(loaded, tokens, params)
        row: dict[str, Any] = agreement(alone, batched)
        both = await compute_thread().run(
            score_answers, loaded, tokens, alone + batched, params + params
        )
        row.update(both)
        key = f"t{temperature}_p{top_p}"
        out[key] = row
        log(f"{dtype} {key}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else
                                           f"{k} {v}" for k, v in row.items()))
    out["wall_s"] = time.perf_counter() - t0
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {
        "model": args.model, "answers": args.answers, "answer_tokens": args.answer_tokens,
        "dtypes": {},
    }
    for dtype in args.dtypes:
        log(f"{dtype}: loading {args.model}")
        result["dtypes"][dtype] = await one_dtype(args, dtype)
    result["machine"] = machine(load_before)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling",
                                     description=(__doc__ or "").split("\n")[0])
    add = parser.add_argument
    add("--json", type=Path, required=True)
    add("--model", default=DEFAULT_MODEL)
    add("--dtypes", default="float32,bfloat16,int8")
    add("--answers", type=int, default=6)
    add("--answer-tokens", type=int, default=24)
    add("--prompt-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if args.answers < 1 or args.answer_tokens < 1 or args.prompt_tokens < 32:
        parser.error("--answers and --answer-tokens must be >= 1, --prompt-tokens >= 32")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(trio.run(run, args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
