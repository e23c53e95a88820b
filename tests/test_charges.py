"""What cost a client time is charged, shown in the route and counted in metrics: hedge
races lost, stalls between tokens and decodes far below the claim, on a scripted fake
host under a virtual clock."""

from __future__ import annotations

import pytest
import trio

from peer.api.metrics import Metrics
from peer.engine.engine import SamplingParams
from peer.request.pipeline import GenerationChunk, Outcome
from peer.request.race import TOKEN_GAP_FLOOR_S, TOKEN_GAP_MULTIPLE, token_gap_s
from peer.routing.reliability import HEDGE_LOST_CHARGE
from tests.fake_host import (
    SELF,
    STALL,
    Step,
    answer,
    fake_swarm,
    honest,
    new_peer_id,
    reference,
    request,
)

A, B = new_peer_id(1), new_peer_id(2)
PROMPT = list(range(100, 132))  # 8 blocks of 4
N = 6
PARAMS = SamplingParams(max_new_tokens=N)
HEDGING = {"hedge_multiple": 2.0, "hedge_floor_s": 0.1}


def stall(request):
    return [STALL]


def first_token_then_silence(request):
    first = answer(request, reference(request.prompt_token_ids, request.max_new_tokens))[0]
    return [first, STALL]


async def collect(pipeline, params=PARAMS, prompt=PROMPT, request_id="r"):
    result = None
    async for item in pipeline.stream(request(prompt, params, request_id=request_id)):
        if not isinstance(item, GenerationChunk):
            result = item
    return result


def route(result):
    return [(a.peer_id, a.outcome) for a in result.route]


async def test_a_hedge_race_lost_is_charged_and_a_staller_is_demoted_at_the_second(
    autojump_clock,
):
    swarm = fake_swarm({A: (7, stall), B: (6, honest())}, PROMPT, **HEDGING)
    first = await collect(swarm.pipeline)
    assert route(first) == [(A, Outcome.STALLED), (B, Outcome.OK)]
    lost = first.route[0]
    assert lost.charged == HEDGE_LOST_CHARGE
    assert lost.waited_s == pytest.approx(0.11)  # from its start to B's first token
    assert first.ttft_s == pytest.approx(0.11)
    second = await collect(swarm.pipeline, request_id="r2")
    assert route(second)[0] == (A, Outcome.STALLED)  # one hedge lost: still first
    assert swarm.trust.debt(A, trio.current_time()) > 0.9
    dials = len(swarm.host.dials)
    third = await collect(swarm.pipeline, request_id="r3")
    assert route(third) == [(B, Outcome.OK)]  # demoted: after this peer, so never tried
    assert [peer for _, peer in swarm.host.dials[dials:]] == [B]
    assert third.ttft_s == pytest.approx(0.01)
    ranked = swarm.pipeline._rank(PROMPT, PARAMS, trio.current_time())
    assert [c.peer_id for c in ranked] == [B, SELF, A]
    assert "tried after self" in ranked[2].reason
    stats = swarm.pipeline.statistics()
    assert stats["charged_hedge_lost"] == 2


async def test_an_honest_peer_that_loses_one_hedge_keeps_its_place(autojump_clock):
    answered = []

    def slow_once(request):
        answered.append(request.request_id)
        ttft = 0.5 if len(answered) == 1 else 0.01
        tokens = reference(request.prompt_token_ids, request.max_new_tokens)
        return answer(request, tokens, ttft, cached=28)  # the 7 blocks it claims

    swarm = fake_swarm({A: (7, slow_once), B: (6, honest())}, PROMPT, **HEDGING)
    first = await collect(swarm.pipeline)
    assert route(first) == [(A, Outcome.STALLED), (B, Outcome.OK)]
    for i in range(8):
        result = await collect(swarm.pipeline, request_id=f"r{i}")
        assert route(result) == [(A, Outcome.OK)]
    assert swarm.trust.debt(A, trio.current_time()) == 0.0  # repaid by its answers


async def test_a_stall_between_tokens_is_charged_like_a_failure(autojump_clock):
    swarm = fake_swarm({A: (7, first_token_then_silence), B: (6, honest())}, PROMPT,
                       forward_token_gap_s=0.5)
    result = await collect(swarm.pipeline)
    assert route(result) == [(A, Outcome.HANDED_OVER), (B, Outcome.OK)]
    handed = result.route[0]
    assert handed.charged == 1.0 and handed.tokens == 1
    assert handed.waited_s == pytest.approx(0.5)  # silent from its first token to the gap
    assert list(result.token_ids) == reference(PROMPT, N)
    again = swarm.pipeline._rank(PROMPT, PARAMS, trio.current_time())
    assert [c.peer_id for c in again] == [B, SELF, A]
    assert swarm.pipeline.statistics()["charged_stalled"] == 1


async def test_a_decode_far_below_the_claim_is_charged_on_a_served_response(autojump_clock):
    # The summary claims 100 tokens/s of decode; the stream delivers one a second.
    swarm = fake_swarm({A: (7, honest(gap_s=1.0)), B: (6, honest())}, PROMPT)
    params = SamplingParams(max_new_tokens=10)
    result = await collect(swarm.pipeline, params)
    assert route(result) == [(A, Outcome.OK)]
    assert result.route[0].charged == 1.0
    assert "slower than it claimed" in result.route[0].detail
    assert swarm.trust.view(A).lapses == 1
    ranked = swarm.pipeline._rank(PROMPT, params, trio.current_time())
    assert ranked[0].peer_id == B  # demoted
    # Observed now: priced at no more than twice what it delivered, whatever it claims.
    a = next(c for c in ranked if c.peer_id == A)
    assert a.estimate.decode_tokens_per_s == pytest.approx(2.0)


async def test_a_decode_near_the_claim_is_not_charged(autojump_clock):
    swarm = fake_swarm({A: (7, honest(gap_s=0.02)), B: (6, honest())}, PROMPT)
    result = await collect(swarm.pipeline, SamplingParams(max_new_tokens=10))
    assert result.route[0].charged == 0.0 and result.route[0].detail == ""
    assert swarm.trust.view(A).lapses == 0


async def test_the_time_lost_and_the_charges_reach_the_metrics(autojump_clock):
    swarm = fake_swarm({A: (7, stall), B: (6, honest())}, PROMPT, **HEDGING)
    result = await collect(swarm.pipeline)
    metrics = Metrics()
    metrics.record_route(result.route)
    text = metrics.render().decode()
    assert 'prefixswarm_forward_wait_seconds_total{outcome="stalled"} 0.11' in text
    assert f'prefixswarm_forward_charges_total{{outcome="stalled"}} {HEDGE_LOST_CHARGE}' in text


async def test_a_peer_that_breaks_before_a_token_is_charged_a_failure(autojump_clock):
    swarm = fake_swarm({A: (7, lambda r: [Step(0.2, None)]), B: (6, honest())}, PROMPT)
    result = await collect(swarm.pipeline)
    assert route(result) == [(A, Outcome.FAILED), (B, Outcome.OK)]
    assert result.route[0].charged == 1.0
    assert result.route[0].waited_s == pytest.approx(0.2)


async def test_silence_between_tokens_is_a_stall_after_a_multiple_of_the_token_time(
    autojump_clock,
):
    # Default gap (10 s); the estimate prices a token at 1/100 s: the floor, 2 s, applies.
    swarm = fake_swarm({A: (7, first_token_then_silence), B: (6, honest())}, PROMPT)
    ranked = swarm.pipeline._rank(PROMPT, PARAMS, 0.0)
    assert token_gap_s(swarm.pipeline.config, ranked[0]) == TOKEN_GAP_FLOOR_S
    result = await collect(swarm.pipeline)
    assert route(result) == [(A, Outcome.HANDED_OVER), (B, Outcome.OK)]
    assert result.route[0].waited_s == pytest.approx(TOKEN_GAP_FLOOR_S)


def test_a_slow_peer_gets_a_longer_gap_up_to_the_configured_one():
    swarm = fake_swarm({A: (7, honest())}, PROMPT)
    a = swarm.pipeline._rank(PROMPT, PARAMS, 0.0)[0]
    slow = a._replace(estimate=a.estimate._replace(decode_tokens_per_s=4.0))
    assert token_gap_s(swarm.pipeline.config, slow) == TOKEN_GAP_MULTIPLE / 4.0
    crawling = a._replace(estimate=a.estimate._replace(decode_tokens_per_s=0.5))
    assert token_gap_s(swarm.pipeline.config, crawling) == swarm.pipeline.config.forward_token_gap_s
