"""Load probes in the pipeline's routing step, on the scripted fake host under a virtual
clock: exact times for a probe answered, late, refused, garbled or lied in, and with the
hedged race after it."""

from __future__ import annotations

import pytest
import trio

from peer.config import Policy
from peer.engine.engine import SamplingParams
from peer.request.pipeline import GenerationChunk, Outcome
from peer.routing.probing import ProbeSettings, plan_probes
from protocols.load import LoadReport
from tests.fake_host import (
    SELF,
    FakeEngine,
    LoadAnswer,
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
GOOD = reference(PROMPT, N)
IDLE = LoadReport(0, 0)


def swarm(answer: LoadAnswer | None = None, **config):
    """A holds 7 of the prompt's 8 blocks but gossips 8 running requests; B holds 6 and is
    idle: B ranks first, and A is worth a probe (idle, it would beat B)."""
    config.setdefault("policy", Policy.COST)
    s = fake_swarm({A: (7, honest()), B: (6, honest())}, PROMPT, running={A: 8}, **config)
    if answer is not None:
        s.host.load[A] = answer
    return s


async def collect(pipeline):
    result = None
    async for item in pipeline.stream(request(PROMPT, PARAMS)):
        if not isinstance(item, GenerationChunk):
            result = item
    return result


def route(result):
    return [(a.peer_id, a.outcome) for a in result.route]


def test_the_scenario_probes_a_alone_for_its_gain():
    s = swarm()
    ranked = s.pipeline._rank(PROMPT, PARAMS, 0.0)
    assert [c.peer_id for c in ranked] == [B, SELF, A]
    plan = plan_probes(ranked, ProbeSettings())
    assert plan.peers == (A,)
    assert plan.wait_s == 0.02  # the floor: 4 round trips of 1 ms are less, the gain more


async def test_a_probe_answered_in_time_moves_the_request_to_the_idle_peer(autojump_clock):
    s = swarm(LoadAnswer(0.005, IDLE))
    result = await collect(s.pipeline)
    assert s.host.probes == [(0.0, A)]
    assert s.host.dials == [(0.005, A)]  # as soon as the only answer is in, not at 0.02
    assert route(result) == [(A, Outcome.OK)]
    assert list(result.token_ids) == GOOD
    assert result.ttft_s == pytest.approx(0.015)
    stats = s.pipeline.statistics()
    assert stats["probe_answered"] == 1 and stats["probe_changed_choice"] == 1


async def test_without_probes_the_request_goes_where_gossip_says(autojump_clock):
    s = swarm(LoadAnswer(0.005, IDLE), load_probes=0)
    result = await collect(s.pipeline)
    assert s.host.probes == [] and s.host.dials == [(0.0, B)]
    assert route(result) == [(B, Outcome.OK)]


async def test_a_late_answer_costs_the_deadline_and_no_more(autojump_clock):
    s = swarm(LoadAnswer(1.0, IDLE))
    result = await collect(s.pipeline)
    assert s.host.dials == [(0.02, B)]  # ranked on gossip once the 20 ms were up
    assert s.host.probe_resets == [(0.02, A)]  # the probe is abandoned, not left open
    assert s.host.load_answers == []
    assert route(result) == [(B, Outcome.OK)]
    assert s.pipeline.statistics()["probe_unanswered"] == 1


async def test_a_refused_probe_costs_nothing(autojump_clock):
    s = swarm()  # A does not speak the load protocol
    result = await collect(s.pipeline)
    assert s.host.probes == [(0.0, A)]
    assert s.host.dials == [(0.0, B)]
    assert route(result) == [(B, Outcome.OK)]
    assert s.pipeline.statistics()["probe_refused"] == 1


@pytest.mark.parametrize(
    "answer",
    [
        LoadAnswer(0.005, None),  # the stream breaks
        LoadAnswer(0.005, None, raw=b"\xa0"),  # an empty CBOR map: not a report
        LoadAnswer(0.005, None, raw=b"\xff\xff"),  # not CBOR
    ],
)
async def test_a_broken_or_garbled_answer_is_no_answer(autojump_clock, answer):
    s = swarm(answer)
    result = await collect(s.pipeline)
    assert s.host.dials == [(0.005, B)]
    assert route(result) == [(B, Outcome.OK)]
    assert s.pipeline.statistics()["probe_refused"] == 1


async def test_a_lie_in_a_probe_is_floored_by_our_own_forwards_there(autojump_clock):
    """A claims to be idle while this peer has 8 forwards in flight there: its load
    counts as those 8 (what a summary claiming idle would get), and B keeps the request."""
    s = swarm(LoadAnswer(0.005, IDLE))
    for _ in range(8):
        s.table.record_forward(A, len(PROMPT), 0.0)
    result = await collect(s.pipeline)
    assert s.host.probes == [(0.0, A)]
    assert s.host.dials == [(0.005, B)]
    assert route(result) == [(B, Outcome.OK)]


async def test_a_peer_quarantined_while_probed_is_not_chosen_for_its_answer(autojump_clock):
    s = swarm(LoadAnswer(0.01, IDLE))

    async def catch_a_lie():
        await trio.sleep(0.005)
        s.trust.quarantine(A, "wrong tokens for another request", trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(catch_a_lie)
        result = await collect(s.pipeline)
    assert s.host.dials == [(0.01, B)]
    assert A not in s.host.dialed()
    assert route(result) == [(B, Outcome.OK)]


async def test_the_race_hedges_after_the_probe(autojump_clock):
    s = swarm(LoadAnswer(0.005, IDLE), hedge_multiple=2.0, hedge_floor_s=0.1)
    s.host.scripts[A] = honest(ttft_s=0.5)  # idle, it said, but slow to its first token
    result = await collect(s.pipeline)
    assert s.host.dials == [(0.005, A), (pytest.approx(0.105), B)]
    assert route(result) == [(A, Outcome.STALLED), (B, Outcome.OK)]
    assert result.ttft_s == pytest.approx(0.115)
    assert list(result.token_ids) == GOOD


class SaltedEngine(FakeEngine):
    def stream(self, prompt, params, cache_salt=None, background=False):
        return super().stream(prompt, params)


async def test_a_private_request_is_never_probed_for(autojump_clock):
    s = swarm(LoadAnswer(0.005, IDLE), engine=SaltedEngine())
    result = None
    async for item in s.pipeline.stream(request(PROMPT, PARAMS, cache_salt=b"secret")):
        result = item
    assert s.host.probes == [] and s.host.dials == []
    assert route(result) == [(SELF, Outcome.OK)] and result.ttft_s == 0.5
