"""What a generation request is: its parameters and their limits, what it yields, and
how its tokens are sampled and cut at stop strings (used by peer/engine/engine.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_NEW_TOKENS = 4096  # ~5 min of SmolLM2 decode on 2 cores: one request can't hold a peer longer
MAX_STOP_STRINGS = 8  # OpenAI allows 4; bounds the per-token stop-string check
MAX_STOP_CHARS = 256  # one stop string longer than this is a mistake, not a delimiter
MAX_TEMPERATURE = 100.0  # beyond this sampling is uniform noise; also rejects inf
MAX_SEED = (1 << 63) - 1  # torch.Generator takes a signed 64-bit seed
MAX_PROMPT_CHARS_PER_TOKEN = 32  # longer text than this x max_context can't fit: don't tokenize
MAX_CHAT_MESSAGES = 1024  # bounds the chat-template work for one request


class EngineError(Exception):
    """The engine could not serve a request."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is invalid; the message names the limit it broke."""


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. temperature 0 is greedy; `seed` makes sampling reproducible."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise InvalidRequest naming the broken limit."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidRequest(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidRequest(
                f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}"
            )
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidRequest(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequest(f"seed must be an int in [0, {MAX_SEED}], got {self.seed!r}")
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop must be a tuple of at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise InvalidRequest(
                    f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {s!r}"
                )


@dataclass(frozen=True)
class Usage:
    """What a request cost. ttft_s counts from submission (queueing included)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it adds (may be empty while a stop string is pending)."""

    index: int
    token_id: int
    text: str


@dataclass(frozen=True)
class Completion:
    """The finished request. finish_reason: "stop" (EOS or a stop string) or "length"."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage


@dataclass(frozen=True)
class EngineLoad:
    """What the router needs: queued work and measured speeds (0.0 = not measured yet)."""

    queued_prompt_tokens: int
    running_requests: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=generator))
    sorted_p, order = torch.sort(probs, descending=True)
    keep = (torch.cumsum(sorted_p, dim=0) - sorted_p) < params.top_p  # always keeps the first
    choice = torch.multinomial(sorted_p * keep, 1, generator=generator)
    return int(order[choice])


class StopTracker:
    """Turns generated ids into text deltas, holding back text that may start a stop string."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._emitted = 0  # characters already handed out
        self.text = ""  # the completion's text so far (final once finished)

    def push(self, generated: Sequence[int], final: bool) -> tuple[str, bool]:
        """(new text, whether a stop string ended the completion)."""
        full = str(self._tokenizer.decode(list(generated), skip_special_tokens=True))
        hits = [i for i in (full.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.text = full[: min(hits)]
            delta = self.text[self._emitted :]
            self._emitted = len(self.text)
            return delta, True
        safe = len(full)
        if not final:
            safe = len(full.rstrip("\ufffd"))  # an incomplete UTF-8 sequence may still change
            for s in self._stops:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        safe = min(safe, len(full) - k)
                        break
        delta = full[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        self.text = full if final else full[: self._emitted]
        return delta, False
