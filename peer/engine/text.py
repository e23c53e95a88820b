"""Generated token ids to text with stop strings: torch-free, shared by the engine (its
own output) and the entry peer's pipeline (text it decodes itself from a remote peer's
tokens, never trusting the remote's text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
