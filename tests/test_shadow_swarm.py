"""Shadow verification across real peers on loopback (tiny-random engines, default trust):
a new honest peer earns its place within a few requests and then serves; a lying one
never reaches a client and is quarantined."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from peer.config import Policy
from peer.engine.api import Completion
from peer.engine.engine import SamplingParams, TokenEvent
from peer.routing.trust import DEFAULT_PROBATION_REQUESTS, TrustState
from tests.helpers_swarm import wait_until
from tests.test_pipeline import reference, start_swarm, tokens, wait_for_match

PARAMS = SamplingParams(max_new_tokens=8)


class WithoutVerifier:
    """An engine that cannot verify: a shadow answer that differs quarantines outright.
    (tiny-random's logits are nearly flat, so its verifier accepts almost any token.)"""

    verify = None

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generating(self) -> Any:
        return self


class LyingEngine:
    """An engine that answers every request with wrong tokens (each id shifted by one),
    consistently: the final Completion (which the serving peer signs) says the same."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generating(self) -> Any:
        return self

    def stream(self, token_ids: Any, params: SamplingParams, **_: Any) -> AsyncGenerator[Any, None]:
        agen = self._inner.stream(token_ids, params)
        vocab = self._inner.vocab_size

        async def lying() -> AsyncGenerator[Any, None]:
            async with contextlib.aclosing(agen):
                async for item in agen:
                    if isinstance(item, TokenEvent):
                        item = TokenEvent(item.index, (item.token_id + 1) % vocab, "")
                    elif isinstance(item, Completion):
                        shifted = tuple((t + 1) % vocab for t in item.token_ids)
                        item = dataclasses.replace(item, token_ids=shifted)
                    yield item

        return lying()


def trust_of(entry: Any, peer: Any) -> TrustState:
    return entry.peer.serving.trust.view(peer.peer.peer_id).state


async def shadows_done(entry: Any) -> None:
    planner = entry.peer.serving.pipeline.shadows.planner
    await wait_until(lambda: planner.in_flight == 0, timeout_s=20, what="the shadow ended")


async def test_a_new_honest_peer_is_trusted_after_k_shadows_then_serves(
    nursery, tiny_engine_factory
):
    # LONGEST_PREFIX: what is tested is trust, not the price of a route. (`cost` may
    # rightly keep a tiny-random prompt here when the shadows' timings, on a loaded
    # machine, made b look slow: seen in CI with every request served locally.)
    a, b = await start_swarm(nursery, [tiny_engine_factory(), tiny_engine_factory()],
                             policy=Policy.LONGEST_PREFIX,
                             probation_requests=DEFAULT_PROBATION_REQUESTS, verify_fraction=0.1)
    me, new = a.peer.peer_id, b.peer.peer_id
    prefix, later = tokens(640, seed=1), tokens(640, seed=2)
    await b.peer.engine.generate(prefix + tokens(9, seed=3), SamplingParams(max_new_tokens=1))
    served_by = []
    for i in range(DEFAULT_PROBATION_REQUESTS + 2):
        # On probation b serves no client: the first K requests run here, with a shadow
        # each; then a prefix that only b holds goes to b.
        prompt = (prefix if i < DEFAULT_PROBATION_REQUESTS else later) + tokens(20, seed=10 + i)
        if i == DEFAULT_PROBATION_REQUESTS:  # (the tiny cache holds one prefix at a time)
            await b.peer.engine.generate(later + tokens(9, seed=3),
                                         SamplingParams(max_new_tokens=1))
        await wait_for_match(a, b, prompt, len(prefix) // 16)
        result = await a.peer.generate(prompt, PARAMS)
        assert result.token_ids == await reference(tiny_engine_factory, prompt, PARAMS)
        served_by.append(result.served_by)
        await shadows_done(a)
    stats = a.peer.serving.pipeline.statistics()
    assert served_by == [me] * DEFAULT_PROBATION_REQUESTS + [new, new], (trust_of(a, b), stats)
    assert trust_of(a, b) is TrustState.TRUSTED
    assert stats["shadow_matched"] == DEFAULT_PROBATION_REQUESTS
    assert stats.get("shadow_mismatched", 0) == 0


async def test_a_lying_newcomer_never_reaches_a_client_and_is_quarantined(
    nursery, tiny_engine_factory
):
    liar_engine = LyingEngine(tiny_engine_factory())
    a, liar = await start_swarm(nursery, [WithoutVerifier(tiny_engine_factory()), liar_engine],
                                policy=Policy.COST, probation_requests=DEFAULT_PROBATION_REQUESTS)
    prefix = tokens(640, seed=4)
    await liar_engine.generate(prefix + tokens(9, seed=5), SamplingParams(max_new_tokens=1))
    for i in range(3):
        prompt = prefix + tokens(20, seed=20 + i)
        if i == 0:
            await wait_for_match(a, liar, prompt, len(prefix) // 16)
        result = await a.peer.generate(prompt, PARAMS)
        assert result.token_ids == await reference(tiny_engine_factory, prompt, PARAMS)
        assert result.served_by == a.peer.peer_id
        await shadows_done(a)
    assert trust_of(a, liar) is TrustState.QUARANTINED
    stats = a.peer.serving.pipeline.statistics()
    assert stats["shadow_mismatched"] == 1 and stats["shadow_sent"] == 1
