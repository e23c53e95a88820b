"""A lying peer on a real swarm (libp2p on loopback, tiny-random engines): its wrong tokens
never reach the client, it is quarantined, and the request completes with the right ones."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import trio

from peer.engine.engine import Completion, SamplingParams, TokenEvent, Verdict
from peer.request.pipeline import GenerationChunk, Outcome
from tests.test_pipeline import claim_prefix, reference, start_swarm, tokens


class WrongEngine:
    """Serves every token shifted by one: plausible ids, wrong output."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generating(self) -> Any:
        return self  # this wrapper, not the engine it wraps, generates

    def stream(self, token_ids: Any, params: SamplingParams, **_: Any) -> Any:
        agen = self._inner.stream(token_ids, params)
        vocab = self._inner.vocab_size

        async def lying() -> Any:
            async with contextlib.aclosing(agen):
                async for item in agen:
                    if isinstance(item, TokenEvent):
                        yield replace(item, token_id=(item.token_id + 1) % vocab)
                    elif isinstance(item, Completion):
                        wrong = tuple((t + 1) % vocab for t in item.token_ids)
                        yield replace(item, token_ids=wrong)

        return lying()


class CheckingEngine:
    """An engine with a `verify` that regenerates greedily and compares (the real one
    teacher-forces; the pipeline only needs the interface)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generating(self) -> Any:
        return self  # this wrapper, not the engine it wraps, generates

    async def verify(self, prompt_ids, output_ids, params) -> Verdict:
        done = await self._inner.generate(prompt_ids, replace(params, max_new_tokens=len(
            output_ids)))
        for i, (got, want) in enumerate(zip(output_ids, done.token_ids, strict=False)):
            if got != want:
                return Verdict(False, i, f"token {i}: {got}, expected {want}", i + 1)
        return Verdict(True, None, "", len(output_ids))


async def test_a_lying_peer_is_caught_and_its_tokens_never_delivered(
    nursery, tiny_engine_factory
):
    entry, liar = await start_swarm(
        nursery,
        [CheckingEngine(tiny_engine_factory()), WrongEngine(tiny_engine_factory())],
        verify_fraction=1.0,
    )
    prompt = tokens(64, seed=31)
    claim_prefix(entry, liar, prompt)  # the liar is everyone's best candidate
    params = SamplingParams(max_new_tokens=8)
    chunks, result = [], None
    with trio.fail_after(60):
        async with contextlib.aclosing(entry.peer.serving.stream(prompt, params)) as items:
            async for item in items:
                if isinstance(item, GenerationChunk):
                    chunks.append(item)
                else:
                    result = item
    liar_id = liar.peer.peer_id
    assert result is not None
    assert result.route[0].peer_id == liar_id
    assert result.route[0].outcome is Outcome.WRONG_OUTPUT
    assert all(c.served_by != liar_id for c in chunks)
    assert result.token_ids == await reference(tiny_engine_factory, prompt, params)
    assert not entry.peer.serving.trust.routable(liar_id)
