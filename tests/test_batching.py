"""Continuous batching: the pure step planner, and the engine serving concurrent requests
in one batch with greedy output identical to uncached, unbatched generation."""

from contextlib import aclosing

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.api import Completion, SamplingParams, TokenEvent
from peer.engine.scheduler import (
    BatchQueue,
    StepPlan,
    admit_count,
    plan_step,
    waits_for_shared_prefill,
)

GREEDY3 = SamplingParams(max_new_tokens=3)


def prompt(n, start=100):
    return [start + 7 * i % 5000 for i in range(n)]


# -- the planner (pure) -------------------------------------------------------------------


@given(
    decoding=st.lists(st.integers(0, 10**6), max_size=40, unique=True),
    remaining=st.lists(st.integers(1, 3000), max_size=10),
    budget=st.integers(1, 1024),
)
def test_plan_decodes_everyone_and_fills_the_budget_with_prefill(decoding, remaining, budget):
    prefilling = [(10**7 + i, n) for i, n in enumerate(remaining)]
    plan = plan_step(decoding, prefilling, budget)
    assert plan.decode == tuple(decoding)  # a stream never waits for a prompt
    chunks = dict(plan.prefill)
    assert list(chunks) == [rid for rid, _ in prefilling[: len(chunks)]]  # oldest first
    assert all(1 <= chunks[rid] <= n for rid, n in prefilling if rid in chunks)
    # only the last chunk may be partial: earlier prompts are read to the end first
    assert all(chunks[rid] == n for rid, n in prefilling[: len(chunks) - 1])
    prefill = sum(chunks.values())
    if prefilling:
        assert prefill >= 1  # prompts always advance
        assert prefill == min(sum(remaining), max(budget - len(decoding), 1))
    assert plan.num_tokens == len(decoding) + prefill
    assert bool(plan) == bool(decoding or prefilling)


def test_plan_examples():
    assert plan_step([1, 2], [(3, 500), (4, 10)], 256) == StepPlan((1, 2), ((3, 254),))
    assert plan_step([1], [(3, 5), (4, 10)], 256) == StepPlan((1,), ((3, 5), (4, 10)))
    assert plan_step(list(range(300)), [(999, 7)], 256).prefill == ((999, 1),)
    assert admit_count(5, 30, 32) == 2 and admit_count(5, 40, 32) == 0


def test_a_prompt_waits_for_one_being_read_that_gives_it_another_block():
    prompt = list(range(100))  # 6 reusable blocks of 16 (the last token is computed)
    read = [prompt[:40] + [7] * 60]  # shares 2 whole blocks and 8 tokens
    assert waits_for_shared_prefill(prompt, 0, 16, read)  # 2 blocks more than cached
    assert waits_for_shared_prefill(prompt, 16, 16, read)  # still one more
    assert not waits_for_shared_prefill(prompt, 32, 16, read)  # nothing more to gain
    assert not waits_for_shared_prefill(prompt, 96, 16, [prompt])  # all reusable cached
    assert not waits_for_shared_prefill(prompt, 0, 16, [[1, *prompt[1:]]])
    assert not waits_for_shared_prefill(prompt, 0, 16, [])
    assert not waits_for_shared_prefill(prompt[:16], 0, 16, [prompt])  # no reusable block


class Seq:
    def __init__(self, rid, n):
        self.rid, self.tokens, self.pos = rid, list(range(n)), 0


def test_batch_queue_admits_oldest_first_up_to_max_running_and_plans_over_the_batch():
    queue = BatchQueue()
    seqs = [Seq(i, 10 * (i + 1)) for i in range(4)]
    for seq in seqs:
        queue.submit(seq)
    joined = []

    def join(seq):
        joined.append(seq.rid)
        seq.pos = 5  # matched in the cache when it joins
        assert seq.rid not in queue.batch  # it enters right after join

    queue.admit(3, join, hold=lambda seq: seq.rid == 1)  # 1 is held back, 3 takes its place
    assert joined == [0, 2, 3] and list(queue.batch) == [0, 2, 3]
    assert [s.rid for s in queue.waiting] == [1]
    seqs[0].pos = 10  # read to the end: decoding
    assert queue.plan(20) == StepPlan((0,), ((2, 19),))
    queue.admit(3, join)  # full: 1 keeps waiting
    assert [s.rid for s in queue.waiting] == [1]
    queue.finish(0)
    queue.finish(0)  # no-op once gone
    queue.admit(3, join)
    assert list(queue.batch) == [2, 3, 1] and not queue.waiting
    queue.leave(seqs[3])
    assert list(queue.batch) == [2, 1]
    waiting = Seq(9, 4)
    queue.submit(waiting)
    queue.leave(waiting)  # a cancelled request leaves the queue before it is admitted
    assert not queue.waiting


# -- the engine -------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    shared=st.lists(st.integers(0, 49151), min_size=16, max_size=70),
    tails=st.lists(
        st.tuples(
            st.integers(0, 70),
            st.lists(st.integers(0, 49151), min_size=1, max_size=24),
            st.integers(0, 3),  # steps to wait before submitting
        ),
        min_size=2,
        max_size=6,
    ),
    budget_blocks=st.integers(1, 8),
    step_tokens=st.integers(1, 64),
    max_running=st.integers(1, 6),
    order_seed=st.randoms(use_true_random=False),
)
def test_concurrent_cached_generation_equals_uncached_unbatched(
    tiny_engine_factory, shared, tails, budget_blocks, step_tokens, max_running, order_seed
):
    """Random prompts sharing random prefixes, submitted concurrently at random steps in
    random order, a cache budget that forces eviction, random step budgets (chunked
    prefill) and batch limits: every request's greedy tokens equal an uncached engine's
    one request at a time."""
    prompts = [(shared[:cut] + tail, delay) for cut, tail, delay in tails] * 2
    order_seed.shuffle(prompts)
    reference = tiny_engine_factory(cache_bytes=0)
    cached = tiny_engine_factory(cache_bytes=budget_blocks * reference.layout.block_bytes)
    cached.step_tokens, cached.max_running = step_tokens, max_running

    async def run():
        want = {}
        for p, _ in prompts:
            if tuple(p) not in want:
                want[tuple(p)] = (await reference.generate(p, GREEDY3)).token_ids
        got = {}

        async def one(i, p, delay):
            for _ in range(delay):  # let the batch run some steps first
                await cached._advance()
            got[i] = (await cached.generate(p, GREEDY3)).token_ids
            assert cached.cache.num_blocks <= budget_blocks

        async with trio.open_nursery() as nursery:
            for i, (p, delay) in enumerate(prompts):
                nursery.start_soon(one, i, p, delay)
        for i, (p, _) in enumerate(prompts):
            assert got[i] == want[tuple(p)], i

    trio.run(run)
    stats = cached.statistics()
    assert stats["completed_requests"] == len(prompts)
    assert stats["cache_locked_blocks"] == 0 and stats["batch_size"] == 0
    assert stats["max_batch"] <= max_running


async def test_decodes_of_all_requests_share_one_forward(tiny_engine, monkeypatch):
    sizes = []
    real = tiny_engine.runner.forward

    def counting(items, want):
        sizes.append([len(ids) for _, ids in items])
        return real(items, want)

    monkeypatch.setattr(tiny_engine.runner, "forward", counting)
    results = {}

    async def one(i):
        results[i] = await tiny_engine.generate(prompt(20, 100 + 50 * i),
                                                SamplingParams(max_new_tokens=6))

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    assert sizes[0] == [20, 20, 20, 20]  # four prompts admitted together, read in one step
    assert sizes[1:] == [[1, 1, 1, 1]] * 5  # then every decode step carries all four
    assert all(r.finish_reason == "length" for r in results.values())
    assert tiny_engine.statistics()["max_batch"] == 4


async def test_long_prompt_is_chunked_while_decodes_continue(tiny_engine_factory, monkeypatch):
    engine = tiny_engine_factory()
    engine.step_tokens = 32
    sizes = []
    real = engine.runner.forward

    def counting(items, want):
        sizes.append(sorted(len(ids) for _, ids in items))
        return real(items, want)

    monkeypatch.setattr(engine.runner, "forward", counting)
    got = {}

    async def short(task_status=trio.TASK_STATUS_IGNORED):
        async with aclosing(engine.stream(prompt(10), SamplingParams(max_new_tokens=8))) as agen:
            async for event in agen:
                if isinstance(event, TokenEvent) and event.index == 0:
                    task_status.started()
                elif isinstance(event, Completion):
                    got["short"] = event

    async def long():
        got["long"] = await engine.generate(prompt(100, 900), SamplingParams(max_new_tokens=2))

    async with trio.open_nursery() as nursery:
        await nursery.start(short)  # the short request is decoding when the long one arrives
        nursery.start_soon(long)
    # 100 prompt tokens read in chunks of 31 (32 minus one decode) next to the decodes
    first = next(i for i, step in enumerate(sizes) if len(step) == 2)
    assert sizes[first : first + 4] == [[1, 31], [1, 31], [1, 31], [1, 7]]
    reference = tiny_engine_factory(cache_bytes=0)
    assert got["long"].token_ids == (await reference.generate(
        prompt(100, 900), SamplingParams(max_new_tokens=2))).token_ids
    assert got["short"].token_ids == (await reference.generate(
        prompt(10), SamplingParams(max_new_tokens=8))).token_ids


async def test_waiting_requests_are_admitted_between_steps(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.max_running = 2
    seen_waiting = []

    async def one(i):
        await engine.generate(prompt(20, 100 + 50 * i), SamplingParams(max_new_tokens=4))

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(one, i)
        while engine.load().running_requests < 5:  # every request submitted
            await trio.sleep(0)
        while engine.load().running_requests:
            seen_waiting.append(engine.load().waiting_requests)
            await engine._step_done.wait()
    stats = engine.statistics()
    assert stats["max_batch"] == 2 and stats["completed_requests"] == 5
    assert 3 in seen_waiting and seen_waiting[-1] == 0  # 2 admitted, 3 wait, all served


async def test_cancelled_request_leaves_the_batch_at_the_next_step(tiny_engine, monkeypatch):
    sizes = []
    real = tiny_engine.runner.forward

    def counting(items, want):
        sizes.append(len(items))
        return real(items, want)

    monkeypatch.setattr(tiny_engine.runner, "forward", counting)
    done = {}

    async def stays():
        done["stays"] = await tiny_engine.generate(prompt(20), SamplingParams(max_new_tokens=10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stays)
        async with aclosing(tiny_engine.stream(prompt(20, 700),
                                               SamplingParams(max_new_tokens=500))) as agen:
            async for event in agen:
                if event.index == 2:
                    break
        n_at_cancel = len(sizes)
    assert done["stays"].finish_reason == "length"
    assert sizes[n_at_cancel:] and all(n == 1 for n in sizes[n_at_cancel + 1 :])
    stats = tiny_engine.statistics()
    assert stats["cancelled_requests"] == 1 and stats["cache_locked_blocks"] == 0


async def test_a_prefix_being_read_is_computed_once(tiny_engine_factory):
    """Requests sharing a prefix that arrive together: the first reads it, the others wait
    for its blocks and compute only their own tails."""
    engine = tiny_engine_factory()
    shared = prompt(64, 300)
    tails = [prompt(5 + i, 2000 + 100 * i) for i in range(3)]
    got = {}

    async def one(i):
        got[i] = await engine.generate(shared + tails[i], GREEDY3)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
    assert sorted(g.usage.cached_tokens for g in got.values()) == [0, 64, 64]
    stats = engine.statistics()
    assert stats["computed_prompt_tokens"] == 64 + sum(len(t) for t in tails)
    reference = tiny_engine_factory(cache_bytes=0)
    for i in range(3):
        want = await reference.generate(shared + tails[i], GREEDY3)
        assert got[i].token_ids == want.token_ids
