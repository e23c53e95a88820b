"""The warm-up measurement (torch, blocking): a few prefills and decode steps on fresh
sequences seed the speeds an engine advertises before any request has sampled them.
`progress`, when given, is told after each forward how many of the most it can take are
done (peer.progress.Bar.update's arguments), so start-up can show a bar."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .runner import Runner
from .speeds import WARMUP_PROMPT_TOKENS, ewma, warmup_prefill_speed

WARMUP_DECODE_TOKENS = 4
WARMUP_DECODE_PASSES = 2  # the first pass pays one-time costs; the second is the sample

Progress = Callable[[int, int, str], None]  # (forwards done, most forwards, what now)


def max_prefill_probes(max_prefill_tokens: int) -> int:
    """The most prefill probes `speeds.warmup_prefill_speed` runs: from
    WARMUP_PROMPT_TOKENS, doubling while the double fits in `max_prefill_tokens`."""
    probes, tokens = 1, WARMUP_PROMPT_TOKENS
    while 2 * tokens <= max_prefill_tokens:
        probes, tokens = probes + 1, 2 * tokens
    return probes


def warmup_forwards(max_prefill_tokens: int) -> int:
    """The most forwards a warm-up runs (the bar's total)."""
    decode = WARMUP_DECODE_PASSES * (1 + WARMUP_DECODE_TOKENS)
    return decode + max_prefill_probes(max_prefill_tokens)


def measure_speeds(
    runner: Runner, vocab_size: int, max_prefill_tokens: int, progress: Progress | None = None
) -> tuple[float, float]:
    """(decode, prefill) tokens per second of `runner`'s model, measured now; the prefill
    probe grows up to `max_prefill_tokens` (speeds.warmup_prefill_speed)."""
    total = warmup_forwards(max_prefill_tokens)
    done = 0

    def step(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    def ids(n: int) -> list[int]:
        return [i % vocab_size for i in range(1, n + 1)]

    def time_cold_prefill(n: int) -> float:
        kv = runner.new_kv([], n)
        start = time.perf_counter()
        runner.forward([(kv, ids(n))], [True])
        seconds = time.perf_counter() - start
        step(f"prefill {n} tokens")
        return seconds

    decode_tps = 0.0
    for _ in range(WARMUP_DECODE_PASSES):
        kv = runner.new_kv([], WARMUP_PROMPT_TOKENS + WARMUP_DECODE_TOKENS)
        tok = int(torch.argmax(runner.forward([(kv, ids(WARMUP_PROMPT_TOKENS))], [True])[0]))
        step("decode")
        decode_tps = 0.0
        for _ in range(WARMUP_DECODE_TOKENS):
            start = time.perf_counter()
            tok = int(torch.argmax(runner.forward([(kv, [tok])], [True])[0]))
            decode_tps = ewma(decode_tps, 1.0 / (time.perf_counter() - start))
            step("decode")
    prefill_tps = warmup_prefill_speed(
        time_cold_prefill, decode_tps, WARMUP_PROMPT_TOKENS, max_prefill_tokens
    )
    if progress is not None and done < total:  # the prefill probe stopped early
        progress(total, total, "done")
    return decode_tps, prefill_tps
