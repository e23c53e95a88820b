"""Engine.verify and private cache salts on the batching engine: a verification runs in
chunks outside the batch, never during a step, and lets the batch take a step between its
chunks; salted requests and verifications share blocks only within their salt, also
while requests run concurrently."""

import threading

import trio

import peer.engine.verify as verify_module
from peer.engine.engine import SamplingParams

SALT = b"tenant-a"


def prompt(n, start=100):
    return [start + 7 * i % 5000 for i in range(n)]


async def test_verification_interleaves_with_decoding_and_never_overlaps_a_step(
    tiny_engine_factory, monkeypatch
):
    engine = tiny_engine_factory()
    reference = tiny_engine_factory(cache_bytes=0)
    long_prompt, long_params = prompt(300), SamplingParams(max_new_tokens=600)
    long_out = list((await reference.generate(long_prompt, long_params)).token_ids)
    short_prompt, short_params = prompt(20, 7), SamplingParams(max_new_tokens=60)
    short_alone = await reference.generate(short_prompt, short_params)

    log: list[str] = []
    active = 0
    overlaps = 0
    guard = threading.Lock()
    forward = engine.runner.forward

    def counted_forward(items, want):
        nonlocal active, overlaps
        with guard:
            active += 1
            overlaps += active > 1
        try:
            return forward(items, want)
        finally:
            with guard:
                active -= 1

    score_chunk = verify_module.score_chunk

    def logged_chunk(*args):
        log.append("V")
        return score_chunk(*args)

    compute = engine._compute

    def logged_compute(work):
        log.append("S")
        return compute(work)

    monkeypatch.setattr(engine.runner, "forward", counted_forward)
    monkeypatch.setattr(verify_module, "score_chunk", logged_chunk)
    monkeypatch.setattr(engine, "_compute", logged_compute)

    results = {}

    async def generate(task_status=trio.TASK_STATUS_IGNORED):
        agen = engine.stream(short_prompt, short_params)
        async for item in agen:
            if "first" not in results:
                results["first"] = item
                task_status.started()
            results["done"] = item
        await agen.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(generate)  # decoding when the verification starts
        verdict = await engine.verify(long_prompt, long_out, long_params)
    assert verdict.ok and verdict.checked_tokens == 600
    assert results["done"].token_ids == short_alone.token_ids
    assert overlaps == 0
    sequence = "".join(log)
    # 899 tokens fed in 4 chunks of up to 256, all while the request decoded, each chunk
    # after a batch step: neither the verification nor the batch waits for the other's end.
    assert sequence.count("V") == 4
    assert "VV" not in sequence and sequence.endswith("S"), sequence


async def test_salted_verification_reads_only_its_salt_and_writes_nothing(tiny_engine_factory):
    engine = tiny_engine_factory()
    p, params = prompt(40), SamplingParams(max_new_tokens=24)
    out = list((await tiny_engine_factory().generate(p, params)).token_ids)
    verdict = await engine.verify(p, out, params, cache_salt=SALT)
    assert verdict.ok and verdict.cached_tokens == 0
    assert engine.cache.num_blocks == 0  # verification caches nothing, salted or not
    await engine.generate(p, SamplingParams(max_new_tokens=1), cache_salt=SALT)
    again = await engine.verify(p, out, params, cache_salt=SALT)
    assert (again.ok, again.cached_tokens) == (True, 32)
    public = await engine.verify(p, out, params)
    assert (public.ok, public.cached_tokens) == (True, 0)
    assert engine.local_match_tokens(p + out, SALT) == 32
    assert list(engine.cache.cached_hashes()) == []  # nothing to announce


async def test_concurrent_requests_share_blocks_only_within_their_salt(tiny_engine):
    p, params = prompt(40), SamplingParams(max_new_tokens=4)
    done = {}

    async def run(name, salt):
        done[name] = await tiny_engine.generate(p, params, cache_salt=salt)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "public", None)
        nursery.start_soon(run, "private", SALT)
    # Neither waited for nor reused the other's prefill: both prompts were read in the
    # first step, then three decode steps.
    assert done["public"].usage.cached_tokens == done["private"].usage.cached_tokens == 0
    assert tiny_engine.statistics()["steps"] == 4
    assert done["public"].token_ids == done["private"].token_ids
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "private2", SALT)
        nursery.start_soon(run, "public2", None)
    assert done["private2"].usage.cached_tokens == done["public2"].usage.cached_tokens == 32
    assert tiny_engine.local_match_tokens(p) == tiny_engine.local_match_tokens(p, SALT) == 32
