"""How an engine measures the speeds it advertises (pure; the simulator imports it too).

A prefill chunk of n tokens takes about one decode step (the fixed cost of a forward
call: the weights read once, Python) plus n - 1 tokens' worth. Prefill speed is sampled
as n / time over chunks of at least PREFILL_SAMPLE_MIN_TOKENS tokens that took at least
two decode steps, so that the fixed cost is a share of the sample, not all of it: a cache
hit's short suffix, almost all fixed cost, would make a peer that serves hits look slow.
The fixed cost stays inside the speed, since every queued request pays it. docs/engine.md
("How the advertised speeds are sampled") has the measurements behind both rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "MIN_OBSERVED_DECODE_TOKENS",
    "MIN_OBSERVED_PREFILL_TOKENS",
    "PREFILL_SAMPLE_MIN_TOKENS",
    "SPEED_EWMA_ALPHA",
    "WARMUP_PROMPT_TOKENS",
    "StepSpeeds",
    "ewma",
    "forward_speeds",
    "observe_step",
    "prefill_speed_sample",
    "warmup_max_prompt_tokens",
    "warmup_prefill_speed",
]

SPEED_EWMA_ALPHA = 0.2  # weight of the newest speed sample: smooths ~2x noise over ~5 samples
PREFILL_SAMPLE_MIN_TOKENS = 16  # one block: shorter chunks are all fixed cost
WARMUP_PROMPT_TOKENS = 64  # enough to measure prefill speed without delaying start-up
# A forward's speeds are observed (they cap what the peer advertises) only when compute
# dominates the round trips and overheads in its timing: a cache hit that computes 3
# tokens in 10 ms says nothing of the peer's prefill speed.
MIN_OBSERVED_PREFILL_TOKENS = 64
MIN_OBSERVED_DECODE_TOKENS = 8
# A prefill observation leaves out the round trip the router priced, but keeps at least
# 1 / this of the time to the first token: a round trip misjudged (or a cache hit that
# computed a little in less than one) cannot make the compute time vanish.
OBSERVED_PREFILL_CREDIT = 4.0


class StepSpeeds(NamedTuple):
    """An engine's speed estimates (tokens/s; 0.0 = not measured yet)."""

    prefill: float
    decode: float  # one stream, at the batch of the steps measured
    batch_decode: float  # all streams of those steps together


def forward_speeds(
    computed_tokens: int,
    ttft_s: float | None,
    produced: int,
    decode_span_s: float | None,
    *,
    queued_tokens: int = 0,
    rtt_s: float = 0.0,
    own_prefill_tokens_per_s: float = 0.0,
) -> tuple[float | None, float | None]:
    """What an entry peer learns of a remote peer's speeds from one forward, timed at the
    entry; None where the forward says too little (MIN_OBSERVED_*) or a time is unknown.

    Prefill: the tokens the peer read before our first token, by the router's own pricing
    (``queued_tokens`` it believed queued there when it chose the peer, plus the prompt
    tokens computed), over the time from the request sent to its first token less the
    round trip ``rtt_s`` it priced (OBSERVED_PREFILL_CREDIT bounds what is left out).
    Measured against the queue and round trip the cost model charges, a busy honest peer
    reads about as fast as it is, not as slow as its queue. The queue is the peer's claim:
    the credit lifts an observation at most to ``own_prefill_tokens_per_s`` (the entry's
    own speed, where an unobserved claim is capped too; 0: no credit), and past it only
    the bare tokens over time count, so a peer that claims a queue it did not have gains
    no more than an unobserved one. Decode: (produced - 1) tokens over the first to the
    last token."""
    prefill = decode = None
    if ttft_s is not None and ttft_s > 0 and computed_tokens >= MIN_OBSERVED_PREFILL_TOKENS:
        bare = computed_tokens / ttft_s
        read = computed_tokens + max(queued_tokens, 0)
        compute_s = max(ttft_s - max(rtt_s, 0.0), ttft_s / OBSERVED_PREFILL_CREDIT)
        prefill = max(bare, min(read / compute_s, own_prefill_tokens_per_s))
    if decode_span_s is not None and decode_span_s > 0 and produced >= MIN_OBSERVED_DECODE_TOKENS:
        decode = (produced - 1) / decode_span_s
    return prefill, decode


def observe_step(
    speeds: StepSpeeds, prefill_tokens: int, decodes: int, seconds: float
) -> tuple[StepSpeeds, bool]:
    """The estimates after a batched step of `prefill_tokens` prefill and `decodes` decode
    tokens that took `seconds`, and whether it gave a prefill sample. A step with prefill
    samples the prefill speed (prefill_speed_sample); a decode-only step samples one
    stream's speed (1 / step time) and the batch's (decodes / step time)."""
    if prefill_tokens:
        sample = prefill_speed_sample(prefill_tokens, seconds, speeds.decode)
        if sample is None:
            return speeds, False
        return speeds._replace(prefill=ewma(speeds.prefill, sample)), True
    if seconds > 0 and decodes:
        return StepSpeeds(
            speeds.prefill,
            ewma(speeds.decode, 1.0 / seconds),
            ewma(speeds.batch_decode, decodes / seconds),
        ), False
    return speeds, False


def warmup_max_prompt_tokens(max_context: int) -> int:
    """Where the warm-up's prefill probe stops doubling: half the context window."""
    return max_context // 2


def prefill_speed_sample(tokens: int, seconds: float, decode_tps: float) -> float | None:
    """A prefill chunk's tokens/s, or None when it is too short to say (see above).

    Before decode is measured (``decode_tps <= 0``) every chunk of enough tokens counts.
    """
    if tokens < PREFILL_SAMPLE_MIN_TOKENS or not seconds > 0:
        return None
    if decode_tps > 0 and seconds < 2.0 / decode_tps:
        return None  # mostly the fixed cost of one step
    return tokens / seconds


def warmup_prefill_speed(
    seconds_for: Callable[[int], float], decode_tps: float, tokens: int, max_tokens: int
) -> float:
    """The prefill speed a warm-up measures: `seconds_for(n)` prefills n tokens, from
    `tokens` on, doubling until a sample counts (a tiny model prefills hundreds of tokens
    within two decode steps) or `max_tokens` is reached (then the whole chunk counts)."""
    while True:
        seconds = seconds_for(tokens)
        sample = prefill_speed_sample(tokens, seconds, decode_tps)
        if sample is not None:
            return sample
        if 2 * tokens > max_tokens:
            return tokens / seconds if seconds > 0 else 0.0
        tokens *= 2


def ewma(old: float, sample: float) -> float:
    """The speed estimate after `sample` (the first sample, when `old` is 0, is taken)."""
    return sample if old == 0.0 else (1 - SPEED_EWMA_ALPHA) * old + SPEED_EWMA_ALPHA * sample
