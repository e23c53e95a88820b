"""How a request's tokens are sampled and cut at stop strings (torch); the request types
themselves live in api.py (torch-free).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .api import SamplingParams

__all__ = ["StopTracker", "sample_token"]


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
