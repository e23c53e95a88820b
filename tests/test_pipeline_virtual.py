"""The pipeline's timed paths on the scripted fake host under a virtual clock: forwards
in flight, a hand-over mid-stream (to another peer, to the entry peer), the end-to-end
deadline, a full engine queue. Exact times, exact routes (tests/test_pipeline_trust.py
holds the stall, hedging and trust paths)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from peer.engine.api import SamplingParams
from peer.request.admission import Overloaded
from peer.request.pipeline import DeadlineExceeded, GenerationChunk, GenerationResult, Outcome
from tests.fake_host import (
    SELF,
    STALL,
    FakeEngine,
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


def steps(result: GenerationResult) -> list[tuple[str, Outcome, int]]:
    return [(a.peer_id, a.outcome, a.tokens) for a in result.route]


async def run(swarm, params, **options):
    """(time, item) for every item of one request."""
    items = []
    async for item in swarm.pipeline.stream(request(PROMPT, params, **options)):
        items.append((trio.current_time(), item))
    return items


async def test_a_forward_counts_on_its_target_only_while_it_is_in_flight(autojump_clock):
    swarm = fake_swarm({A: (7, honest(ttft_s=0.2, gap_s=0.05))}, PROMPT)

    def load_on_a() -> tuple[int, int]:
        view = swarm.table.get(A, trio.current_time())
        assert view is not None
        return view.forwards_since_summary, view.forwarded_prompt_tokens

    seen: list[tuple[float, tuple[int, int]]] = []

    async def sample_while_prefilling() -> None:
        await trio.sleep(0.1)
        seen.append((trio.current_time(), load_on_a()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_while_prefilling)
        params = SamplingParams(max_new_tokens=4)
        async for item in swarm.pipeline.stream(request(PROMPT, params)):
            if isinstance(item, GenerationChunk):
                seen.append((trio.current_time(), load_on_a()))
            else:
                result = item
    assert result.served_by == A and steps(result) == [(A, Outcome.OK, 4)]
    # Prefilling: its prompt is queued there; then running until the last token...
    assert seen == [
        (pytest.approx(0.1), (1, len(PROMPT))),
        *((pytest.approx(0.2 + 0.05 * i), (1, 0)) for i in range(4)),
    ]
    # ...and nothing once it is over, long before A's next summary.
    assert load_on_a() == (0, 0)


async def test_a_peer_that_breaks_mid_stream_hands_over_with_the_tokens_so_far(autojump_clock):
    n = 12
    good = reference(PROMPT, n)

    def breaks_after_five(req):
        return [*answer(req, good[:5], ttft_s=0.01, gap_s=0.01)[:5], Step(0.01, None)]

    swarm = fake_swarm({A: (7, breaks_after_five), B: (6, honest())}, PROMPT)
    items = await run(swarm, SamplingParams(max_new_tokens=n))

    *chunks, (end, result) = items
    assert list(result.token_ids) == good and result.finish_reason == "length"
    assert steps(result) == [(A, Outcome.HANDED_OVER, 5), (B, Outcome.OK, 7)]
    assert result.served_by == B
    assert [(round(t, 6), c.served_by) for t, c in chunks] == [
        *((round(0.01 * i, 6), A) for i in range(1, 6)),  # A: 0.01 .. 0.05, breaks at 0.06
        *((round(0.06 + 0.01 * i, 6), B) for i in range(1, 8)),  # B: 0.07 .. 0.13
    ]
    assert end == pytest.approx(0.13)
    assert result.ttft_s == pytest.approx(0.01) and result.total_s == pytest.approx(0.13)
    # B continues from A's tokens: the prompt plus the five, for the seven left.
    (at, peer_id, handed) = swarm.host.requests[1]
    assert (at, peer_id) == (pytest.approx(0.06), B)
    assert list(handed.prompt_token_ids) == PROMPT + good[:5] and handed.max_new_tokens == 7
    assert swarm.pipeline.statistics()["attempt_handed_over"] == 1


async def test_the_entry_peer_takes_over_when_every_remote_breaks(autojump_clock):
    n = 8
    good = reference(PROMPT, n)

    def breaks_after_three(req):
        return [*answer(req, good[:3])[:3], Step(0.01, None)]

    swarm = fake_swarm({A: (7, breaks_after_three)}, PROMPT, engine=FakeEngine(0.5, 0.01))
    *_, (end, result) = await run(swarm, SamplingParams(max_new_tokens=n))
    assert list(result.token_ids) == good
    assert steps(result) == [(A, Outcome.HANDED_OVER, 3), (SELF, Outcome.OK, 5)]
    assert result.served_by == SELF
    # A's three by 0.03, its break at 0.04; here: first token 0.5 s later, then 4 x 0.01.
    assert end == pytest.approx(0.04 + 0.5 + 0.04)


async def test_the_end_to_end_deadline_ends_a_stalled_request_exactly(autojump_clock):
    swarm = fake_swarm({A: (7, lambda req: [STALL])}, PROMPT, engine=FakeEngine(ttft_s=100.0),
                       first_token_floor_s=1.0)
    with pytest.raises(DeadlineExceeded) as info:
        await run(swarm, SamplingParams(max_new_tokens=4), timeout_s=3.0)
    assert trio.current_time() == pytest.approx(3.0)
    assert [(a.peer_id, a.outcome) for a in info.value.attempts] == [
        (A, Outcome.STALLED),  # its first-token deadline passed (the 1 s floor)
        (SELF, Outcome.STALLED),  # the entry's own engine: 100 s to a first token
    ]


async def test_the_first_token_deadline_counts_from_the_request_not_the_stream_setup(
    autojump_clock,
):
    """A peer reached through a slow stream setup (a dial, a relay) answers 0.2 s after
    the request: its 1 s first-token deadline starts when the request goes, so the 1.5 s
    setup is not a stall (nor this entry's own overhead); an answer later than the
    deadline after it is."""
    swarm = fake_swarm({A: (7, honest(ttft_s=0.2))}, PROMPT, engine=FakeEngine(ttft_s=100.0),
                       first_token_floor_s=1.0)
    swarm.host.open_delay_s[A] = 1.5
    *_, (end, result) = await run(swarm, SamplingParams(max_new_tokens=4))
    assert result.served_by == A and steps(result)[-1] == (A, Outcome.OK, 4)
    assert result.ttft_s == pytest.approx(1.7)
    assert swarm.pipeline.router.forward_overhead.extra_s == 0.0  # the setup is not ours
    slow = fake_swarm({A: (7, honest(ttft_s=1.2))}, PROMPT, engine=FakeEngine(ttft_s=0.05),
                      first_token_floor_s=1.0)
    slow.host.open_delay_s[A] = 1.5
    start = trio.current_time()
    *_, (end, result) = await run(slow, SamplingParams(max_new_tokens=4))
    assert [(a.peer_id, a.outcome) for a in result.route] == [
        (A, Outcome.STALLED), (SELF, Outcome.OK)]
    # stalled 1 s after its request went out, 2.5 s in; then the entry's own engine
    assert end - start == pytest.approx(1.5 + 1.0 + 0.05 + 3 * 0.01)


async def test_a_full_engine_queue_and_no_other_peer_is_overloaded_at_once(autojump_clock):
    swarm = fake_swarm({}, PROMPT, engine=FakeEngine(ttft_s=10.0), max_queue=1)
    params = SamplingParams(max_new_tokens=2)
    started = trio.Event()

    async def hold() -> None:
        started.set()
        await run(swarm, params)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await started.wait()
        await trio.sleep(1.0)
        with pytest.raises(Overloaded):
            await run(swarm, params, request_id="second")
        assert trio.current_time() == pytest.approx(1.0)
        nursery.cancel_scope.cancel()


async def test_a_request_is_validated_once_on_its_way_down(autojump_clock):
    from peer.request.serving import Serving
    from tests.fake_host import fake_config, fake_peers

    class CountingEngine(FakeEngine):
        validations = 0

        def validate(self, token_ids, params):
            self.validations += 1
            return super().validate(token_ids, params)

    engine = CountingEngine()
    table, host = fake_peers({A: (7, honest())}, PROMPT, engine)
    config = fake_config(probation_requests=0)  # A trusted: a peer on probation serves no client
    serving = Serving(config=config, engine=engine, table=table, host=host, self_id=SELF)
    prepared = serving.prepare(PROMPT, SamplingParams(max_new_tokens=4), request_id="r1")
    assert engine.validations == 1
    assert (prepared.request_id, prepared.token_ids) == ("r1", tuple(PROMPT))
    items = [item async for item in serving.run(prepared)]
    assert engine.validations == 1  # the pipeline trusts the prepared request
    assert items[-1].served_by == A and list(items[-1].token_ids) == reference(PROMPT, 4)
    # Forwarded as the same parameters, converted at the wire edge only.
    (_, _, forwarded) = host.requests[0]
    assert (forwarded.request_id, forwarded.max_new_tokens, forwarded.hops) == ("r1", 4, 1)
    assert serving.requests.statistics()["ok"] == 1


async def test_the_router_learns_what_a_verified_forward_waited_here(autojump_clock):
    # Verified before delivery, the first token reaches the client after the whole answer
    # (3 more tokens, 0.05 s apart): 0.15 s that the cost model does not count.
    swarm = fake_swarm({A: (7, honest(ttft_s=0.2, gap_s=0.05))}, PROMPT, verify_fraction=1.0)
    overhead = swarm.pipeline.router.forward_overhead
    result = (await run(swarm, SamplingParams(max_new_tokens=4)))[-1][1]
    assert result.served_by == A
    assert overhead.extra_s == pytest.approx(0.15, abs=0.01)
    # A request served here ages it (the entry forgets when it stops forwarding).
    overhead.served_here()
    assert overhead.extra_s == pytest.approx(0.15 * 0.99, abs=0.01)


async def test_an_unverified_forward_teaches_no_extra_on_an_idle_entry(autojump_clock):
    swarm = fake_swarm({A: (7, honest(ttft_s=0.2, gap_s=0.05))}, PROMPT, verify_fraction=0.0)
    result = (await run(swarm, SamplingParams(max_new_tokens=4)))[-1][1]
    assert result.served_by == A
    assert swarm.pipeline.router.forward_overhead.extra_s == pytest.approx(0.0, abs=1e-6)


def _reporting(ttft_s: float, reported_ttft_s: float):
    """A peer whose first token comes `ttft_s` after the request and whose signed result
    says its engine took `reported_ttft_s` to it."""

    def script(req):
        steps = answer(req, reference(req.prompt_token_ids, req.max_new_tokens), ttft_s)
        result = steps[-1].frame
        steps[-1] = Step(0.0, replace(result, ttft_s=reported_ttft_s))
        return steps

    return script


async def test_the_wait_for_a_first_token_beyond_the_serving_engine_is_learned(autojump_clock):
    # The first token comes 0.2 s after the request; the serving engine says it took
    # 0.05 s of that: the other 0.15 s (the stream's handling at both ends) is a cost of
    # forwarding to A that the model does not count. A peer that says its engine took longer than
    # the whole wait teaches nothing of it, and nothing below the entry's own waits.
    learned = {}
    for name, reported in (("honest", 0.2), ("handled", 0.05), ("overstated", 10.0)):
        swarm = fake_swarm({A: (7, _reporting(0.2, reported))}, PROMPT, verify_fraction=0.0)
        result = (await run(swarm, SamplingParams(max_new_tokens=4)))[-1][1]
        assert result.served_by == A
        learned[name] = swarm.pipeline.router.forward_overhead.extra_for(A)
    assert learned["handled"] - learned["honest"] == pytest.approx(0.15, abs=0.005)
    assert learned["overstated"] == pytest.approx(learned["honest"], abs=1e-6)
