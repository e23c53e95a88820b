"""Seeded sampling: the one sampler every peer runs, keyed by (seed, position).

A sampled token is chosen by the Gumbel-max rule over the request's top_p nucleus:

  eligible   the top_p nucleus of softmax(logits / T): tokens sorted by probability,
             kept while the mass strictly before them is below top_p (all at top_p 1)
  score(v)   logits[v] + T * gumbel(seed, position, v)
  token      the eligible v with the highest score (the lowest id on an exact tie)

  gumbel(seed, position, v) = -log(-log(u)),  u = (hash32(seed, position, v) + 0.5) / 2**32

This draws v with probability exp(logits[v] / T) / sum over the nucleus, the distribution
of ordinary top_p sampling, but the draw is fixed by the seed: the noise is a
counter-based hash of integers (below), so every peer, batch shape, device and dtype
computes the same noise, and a verifier that re-scores the output knows which token the
seed selects at each position (verify.py: the chosen token's score must be within a
measured tolerance of the best score). `position` is the token's index in prompt +
output, so an answer handed over after some tokens continues the same draw.

hash32 (pure integer arithmetic; `hash32` below is the reference, `_hash32_rows` the
vectorised form; the tests check that they agree bit for bit):

  mix64(x)     splitmix64's step: x += 0x9E3779B97F4A7C15, then the two multiply-xorshifts
  key          mix64(mix64(seed) ^ position), split into k0 (low 32 bits) and k1 (high)
  mix32(h)     h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x2C1B3C6D; h ^= h >> 16
               (all mod 2**32; both multipliers are below 2**31, so int64 never overflows)
  hash32       mix32(mix32(v ^ k0) ^ k1), a bijection of v for each key: no two tokens
               of one position share a noise value
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "gumbel_noise",
    "hash32",
    "nucleus_masks",
    "perturbed_scores",
    "sample_seeded",
    "token_key",
]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x2C1B3C6D
# Rows of noise built at once: rows x vocab int64 and float64 (49k vocab: 16 rows = 6 MB
# per tensor), so re-scoring a long answer never holds gigabytes of noise.
NOISE_ROWS = 16


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def token_key(seed: int, position: int) -> tuple[int, int]:
    """The two 32-bit halves of the key for one position's noise."""
    if seed < 0 or position < 0:
        raise ValueError(f"seed and position must be >= 0, got {seed}, {position}")
    k = _mix64(_mix64(seed) ^ position)
    return k & _M32, k >> 32


def _mix32(h: int) -> int:
    h ^= h >> 16
    h = (h * _MUL1) & _M32
    h ^= h >> 15
    h = (h * _MUL2) & _M32
    return h ^ (h >> 16)


def hash32(seed: int, position: int, token: int) -> int:
    """The reference hash: 32 bits for (seed, position, token)."""
    k0, k1 = token_key(seed, position)
    return _mix32(_mix32(token ^ k0) ^ k1)


def _mix32_t(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * _MUL1) & _M32
    h = h ^ (h >> 15)
    h = (h * _MUL2) & _M32
    return h ^ (h >> 16)


def _hash32_rows(seed: int, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """hash32 for every (position, token): int64 [len(positions), vocab], on the CPU."""
    keys = torch.tensor([token_key(seed, p) for p in positions], dtype=torch.int64)
    tokens = torch.arange(vocab, dtype=torch.int64)
    return _mix32_t(_mix32_t(tokens[None, :] ^ keys[:, :1]) ^ keys[:, 1:])


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64 [len(positions), vocab] on the CPU, fixed by the seed."""
    u = (_hash32_rows(seed, positions, vocab).double() + 0.5) * 2.0**-32
    return -torch.log(-torch.log(u))


def nucleus_masks(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Per row of `logits` [rows, vocab]: the tokens in the top_p nucleus at `temperature`
    (bool, same shape); every token at top_p >= 1, and always each row's most likely one.
    A top_p below 0 keeps only the most likely token."""
    if top_p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
    keep_sorted[:, 0] = True
    mask = torch.zeros_like(keep_sorted)
    return mask.scatter_(1, order, keep_sorted)


def perturbed_scores(
    logits: torch.Tensor, temperature: float, seed: int, positions: Sequence[int]
) -> torch.Tensor:
    """logits + T * gumbel(seed, position, token): float64 [rows, vocab] on the CPU, row r
    for positions[r]. In logit units, so a tolerance means the same at every temperature."""
    if temperature <= 0.0 or not math.isfinite(temperature):
        raise ValueError(f"seeded sampling needs a temperature > 0, got {temperature}")
    rows = logits.detach().to("cpu", torch.float64)
    return rows + temperature * gumbel_noise(seed, positions, rows.shape[-1])


def sample_seeded(
    logits: torch.Tensor, temperature: float, top_p: float, seed: int, position: int
) -> int:
    """The token the seed selects at `position` from one row of logits [vocab]."""
    row = logits.detach().to("cpu", torch.float32)[None, :]
    scores = perturbed_scores(row, temperature, seed, [position])
    scores = scores.masked_fill(~nucleus_masks(row, temperature, top_p), -math.inf)
    return int(torch.argmax(scores[0]))
