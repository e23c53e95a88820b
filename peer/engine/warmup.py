"""The warm-up measurement (torch, blocking): a few prefills and decode steps on fresh
sequences seed the speeds an engine advertises before any request has sampled them."""

from __future__ import annotations

import time

import torch

from .runner import Runner
from .speeds import WARMUP_PROMPT_TOKENS, ewma, warmup_prefill_speed

WARMUP_DECODE_TOKENS = 4


def measure_speeds(runner: Runner, vocab_size: int, max_prefill_tokens: int) -> tuple[float, float]:
    """(decode, prefill) tokens per second of `runner`'s model, measured now; the prefill
    probe grows up to `max_prefill_tokens` (speeds.warmup_prefill_speed)."""

    def ids(n: int) -> list[int]:
        return [i % vocab_size for i in range(1, n + 1)]

    def time_cold_prefill(n: int) -> float:
        kv = runner.new_kv([], n)
        start = time.perf_counter()
        runner.forward([(kv, ids(n))], [True])
        return time.perf_counter() - start

    decode_tps = 0.0
    for _ in range(2):  # the first pass pays one-time costs; the second is the sample
        kv = runner.new_kv([], WARMUP_PROMPT_TOKENS + WARMUP_DECODE_TOKENS)
        tok = int(torch.argmax(runner.forward([(kv, ids(WARMUP_PROMPT_TOKENS))], [True])[0]))
        decode_tps = 0.0
        for _ in range(WARMUP_DECODE_TOKENS):
            start = time.perf_counter()
            tok = int(torch.argmax(runner.forward([(kv, [tok])], [True])[0]))
            decode_tps = ewma(decode_tps, 1.0 / (time.perf_counter() - start))
    prefill_tps = warmup_prefill_speed(
        time_cold_prefill, decode_tps, WARMUP_PROMPT_TOKENS, max_prefill_tokens
    )
    return decode_tps, prefill_tps
