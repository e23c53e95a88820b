"""How an engine measures the speeds it advertises (pure; the simulator imports it too).

Prefill speed is marginal: a chunk of n tokens takes about one decode step (the fixed cost
of a forward call: the weights read once, Python) plus n - 1 tokens' worth. A chunk is
sampled when it has at least PREFILL_SAMPLE_MIN_TOKENS tokens and took at least two
decode steps, so the part beyond the first step dominates the noise of subtracting it.
Sampling every chunk as n / time instead made a peer that serves cache hits (short
uncached suffixes) report itself 2 to 8x slower than it is, and routing then steered
requests away from its cache (measured on tiny-random: 3k to 30k tokens/s advertised by
four identical peers). The cost model prices a miss by these marginal tokens; the fixed
cost of one step is the same on every candidate.
"""

from __future__ import annotations

__all__ = [
    "PREFILL_SAMPLE_MIN_TOKENS",
    "SPEED_EWMA_ALPHA",
    "ewma",
    "marginal_prefill_speed",
]

SPEED_EWMA_ALPHA = 0.2  # weight of the newest speed sample: smooths ~2x noise over ~5 samples
PREFILL_SAMPLE_MIN_TOKENS = 16  # one block: shorter chunks are all fixed cost


def marginal_prefill_speed(tokens: int, seconds: float, decode_tps: float) -> float | None:
    """Tokens/s a prefill chunk adds beyond one decode step; None if it tells nothing.

    Before decode is measured (``decode_tps <= 0``) the whole chunk counts.
    """
    if tokens < PREFILL_SAMPLE_MIN_TOKENS or not seconds > 0:
        return None
    if decode_tps <= 0:
        return tokens / seconds
    step_s = 1.0 / decode_tps
    if seconds < 2 * step_s:
        return None  # mostly the fixed cost: its marginal part is within the noise
    return (tokens - 1) / (seconds - step_s)


def ewma(old: float, sample: float) -> float:
    """The speed estimate after `sample` (the first sample, when `old` is 0, is taken)."""
    return sample if old == 0.0 else (1 - SPEED_EWMA_ALPHA) * old + SPEED_EWMA_ALPHA * sample
