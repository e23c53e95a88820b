"""Which tokens the next batched step computes (pure; the simulator may import it).

A step runs every decoding sequence's next token and, with the tokens left in the step's
budget, prefill chunks of the sequences still reading their prompts, oldest first. Decodes
go first so that a long prompt arriving never stalls the streams already running for more
than one step's worth of prefill (the budget bounds that step), and a prompt longer than
the budget is read over several steps (chunked prefill) while decodes continue between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_STEP_TOKENS",
    "StepPlan",
    "admit_count",
    "plan_step",
    "reusable_blocks",
    "reusable_tokens",
]

# ~0.5 s of SmolLM2 prefill on 2 CPU cores: the most a running stream waits for a new prompt.
DEFAULT_STEP_TOKENS = 256
# Sequences in the batch at once; more wait (admission happens between steps).
DEFAULT_MAX_RUNNING = 32


@dataclass(frozen=True)
class StepPlan:
    """One step: ids decoding one token each, and (id, tokens) prefill chunks in order."""

    decode: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


def plan_step(
    decoding: Sequence[int], prefilling: Sequence[tuple[int, int]], token_budget: int
) -> StepPlan:
    """The next step for sequences `decoding` (ids) and `prefilling` ((id, prompt tokens
    left), oldest first) within `token_budget` tokens. Every decode is in the step even
    past the budget (a stream never waits for a prompt), and the oldest prefill gets at
    least one token so that prompts always advance."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    left = max(token_budget - len(decoding), 1 if prefilling else 0)
    chunks: list[tuple[int, int]] = []
    for rid, remaining in prefilling:
        if left <= 0:
            break
        if remaining < 1:
            raise ValueError(f"sequence {rid} has {remaining} prompt tokens left")
        n = min(remaining, left)
        chunks.append((rid, n))
        left -= n
    return StepPlan(tuple(decoding), tuple(chunks))


def admit_count(waiting: int, running: int, max_running: int) -> int:
    """How many waiting requests join the batch before the next step."""
    return max(0, min(waiting, max_running - running))


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The most whole blocks of a prompt its cache can supply: at least one prompt token is
    always computed, since its logits give the first generated token."""
    return (prompt_tokens - 1) // block_size if prompt_tokens > 0 else 0


def reusable_tokens(cached_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """Of `cached_tokens` matched in the cache, how many a request reuses (reusable_blocks)."""
    return min(cached_tokens, reusable_blocks(prompt_tokens, block_size) * block_size)
