"""A serving peer cannot tell which of its answers the entry verifies: the stream ends the
same way and at the same moment whether or not a verdict follows, and the request on
the wire is the same (the seed the entry chose included). What the entry's cache (its
summary) shows is tested in tests/test_verify.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from peer.engine.api import SamplingParams, Verdict
from peer.request.pipeline import GenerationResult
from tests.fake_host import FakeEngine, fake_swarm, honest, new_peer_id, request

A = new_peer_id(1)
PROMPT = list(range(100, 132))
VERIFY_S = 5.0  # the verifier's time: long, so a stream held open for it would show


class SlowVerifier(FakeEngine):
    async def verify(self, prompt_ids, output_ids, params) -> Verdict:  # type: ignore[override]
        await trio.sleep(VERIFY_S)
        return await super().verify(prompt_ids, output_ids, params)


async def serve_one(verify_fraction: float, params: SamplingParams):
    engine = SlowVerifier()
    swarm = fake_swarm({A: (7, honest(ttft_s=0.2, gap_s=0.05))}, PROMPT, engine=engine,
                       verify_fraction=verify_fraction)
    start = trio.current_time()
    result = None
    async for item in swarm.pipeline.stream(request(PROMPT, params)):
        if isinstance(item, GenerationResult):
            result = item
    assert result is not None and result.served_by == A
    (dialed_at, _), = swarm.host.dials
    (reset_at, _), = swarm.host.resets
    (_, _, sent), = swarm.host.requests
    return reset_at - dialed_at, trio.current_time() - start, sent, len(engine.verified)


async def test_a_verified_stream_ends_when_an_unverified_one_does(autojump_clock):
    for params in (SamplingParams(max_new_tokens=6),
                   SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)):
        open_plain, took_plain, sent_plain, checks_plain = await serve_one(0.0, params)
        open_checked, took_checked, sent_checked, checks = await serve_one(1.0, params)
        assert (checks_plain, checks) == (0, 1)
        assert took_checked >= took_plain + VERIFY_S  # the client did wait for the verdict
        assert open_checked == pytest.approx(open_plain, abs=1e-9)  # its stream did not
        assert open_plain < 1.0
        assert replace(sent_checked, deadline_s=1.0) == replace(sent_plain, deadline_s=1.0)


async def test_the_entry_seeds_every_sampled_forward(autojump_clock):
    _, _, sent, _ = await serve_one(0.0, SamplingParams(max_new_tokens=6, temperature=1.0))
    assert sent.seed is not None and sent.temperature == 1.0
    _, _, greedy, _ = await serve_one(0.0, SamplingParams(max_new_tokens=6))
    assert greedy.seed is None
    _, _, client, _ = await serve_one(0.0, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                          seed=77))
    assert client.seed == 77  # a client's seed (OpenAI's `seed`) is honoured
