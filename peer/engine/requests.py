"""A request's text: prompts encoded and validated, tokens sampled (torch) and cut at stop
strings. The request types themselves live in api.py (torch-free).
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from .api import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS_PER_TOKEN,
    ContextTooLong,
    InvalidRequest,
    SamplingParams,
    TokenEvent,
)
from .radix import Match
from .runner import SeqKV
from .sampling import sample_seeded
from .text import StopTracker

__all__ = [
    "RequestState",
    "StopTracker",
    "encode_prompt",
    "sample_token",
    "validate_prompt",
]


def encode_prompt(
    tokenizer: Any, prompt: str | Sequence[dict[str, str]], max_context: int
) -> list[int]:
    """Token ids of a text prompt, or of chat messages through the chat template."""
    max_chars = max_context * MAX_PROMPT_CHARS_PER_TOKEN
    if isinstance(prompt, str):
        if len(prompt) > max_chars:
            raise InvalidRequest(f"prompt has {len(prompt)} characters, limit {max_chars}")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if not isinstance(prompt, Sequence) or not 1 <= len(prompt) <= MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"chat needs 1 to {MAX_CHAT_MESSAGES} messages")
    total = 0
    for m in prompt:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise InvalidRequest("each chat message needs string 'role' and 'content'")
        total += len(m["content"])
    if total > max_chars:
        raise InvalidRequest(f"chat has {total} characters, limit {max_chars}")
    try:
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False,
                                             add_generation_prompt=True)
    except (ValueError, TypeError, KeyError) as exc:  # jinja errors subclass these or not
        raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def validate_prompt(
    token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_context: int
) -> list[int]:
    """The prompt as a list of ints, or InvalidRequest naming the limit."""
    params.validate()
    try:
        tokens = [operator.index(t) for t in token_ids]
    except TypeError:
        raise InvalidRequest("token ids must be integers") from None
    if not tokens:
        raise InvalidRequest("the prompt is empty: at least one token is needed")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(tokens) + params.max_new_tokens > max_context:
        raise ContextTooLong(len(tokens), params.max_new_tokens, max_context)
    return tokens


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The next token: the argmax when greedy, else the seeded sampler's choice for the
    token at `position` of prompt + output (sampling.py)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    return sample_seeded(logits, params.temperature, params.top_p, seed, position)


class RequestState:
    """One request inside the engine. Torch fields (kv) are used only in worker steps; the
    rest only on the event loop. A sampled request's params carry its seed (BatchLoop
    draws one when the caller gave none)."""

    def __init__(self, rid: int, tokens: list[int], params: SamplingParams, queued: int,
                 tracker: StopTracker, salt: bytes | None = None) -> None:
        self.rid = rid
        self.tokens = tokens
        self.salt = salt  # a private request's cache namespace (radix.py)
        self.background = False  # served for another peer: yields to this peer's own
        self.params = params
        self.queued = queued  # uncached prompt tokens counted in the engine's queue
        self.tracker = tracker
        self.start = time.perf_counter()
        self.ttft = 0.0
        self.match: Match[torch.Tensor] | None = None
        self.blocks: list[torch.Tensor] | None = None  # matched KV, until `kv` is built
        self.kv: SeqKV | None = None
        self.pos = 0  # prompt tokens whose KV is in the sequence
        self.generated: list[int] = []
        self.outbox: deque[TokenEvent] = deque()
        self.finish: str | None = None
        self.error: BaseException | None = None

    @property
    def seed(self) -> int:
        """The sampler's seed (0 for a greedy request, which draws nothing)."""
        return self.params.seed or 0

    @property
    def next_position(self) -> int:
        """The index in prompt + output of the token the next step samples."""
        return len(self.tokens) + len(self.generated)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.tokens)
