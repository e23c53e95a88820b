"""Engine helpers for tests."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncGenerator
from typing import Any

import pytest
import trio

from peer.engine.engine import SamplingParams, TokenEvent

NEEDS_CXX = pytest.mark.skipif(  # for tests that compile a step
    not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend needs a C++ compiler; none is on the PATH",
)


class SlowEngine:
    """An engine whose tokens come `delay_s` apart: keeps a request running for a test."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generating(self) -> Any:
        return self  # this wrapper, not the engine it wraps, generates

    def stream(self, token_ids: Any, params: SamplingParams, **_: Any) -> AsyncGenerator[Any, None]:
        agen = self._inner.stream(token_ids, params)

        async def slowed() -> AsyncGenerator[Any, None]:
            async with contextlib.aclosing(agen):
                async for item in agen:
                    if isinstance(item, TokenEvent):
                        await trio.sleep(self._delay_s)
                    yield item

        return slowed()


async def assert_serves_like_transformers(engine: Any, model: Any, tokens: list[int]) -> None:
    """Greedy output equals transformers' own generate on `model`, and a second run of
    the same prompt gives the same tokens from the cached prefix (whole blocks of it)."""
    import torch

    first = await engine.generate(tokens, SamplingParams(max_new_tokens=8))
    second = await engine.generate(tokens, SamplingParams(max_new_tokens=8))
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
        )
    assert list(first.token_ids) == out[0, len(tokens):].tolist()
    assert second.token_ids == first.token_ids
    assert second.usage.cached_tokens == (len(tokens) - 1) // engine.block_size * engine.block_size


def assert_greedy_equal_up_to_ties(
    model: Any, prompt: list[int], got: tuple[int, ...], want: tuple[int, ...],
    tolerance: float,
) -> None:
    """`got` equals `want` (greedy tokens from the same weights), or the two part where
    the model's logits for their two tokens are within `tolerance` of each other: with
    bfloat16 activations, chunked or batched prefill rounds differently, and a near-tie
    may go either way. Wrong cache contents move logits by far more than a rounding."""
    import torch

    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g == w:
            continue
        ids = torch.tensor([prompt + list(want[:i])])
        with torch.inference_mode():
            logits = model(ids).logits[0, -1].float()
        gap = float(logits[w] - logits[g])
        assert gap <= tolerance, (
            f"token {i}: {g} instead of {w}, whose logit is {gap:.4f} higher "
            f"(more than a rounding, {tolerance})")
        return  # past a tie the two continuations are different texts
