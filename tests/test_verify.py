"""Teacher-forced verification (Engine.verify) on the tiny-random model: honest outputs
pass, a changed token fails at its index, another model's output fails, structure lies
(too long, after EOS, after a stop string, cut short) fail, a sampled token other than
the one the seed selects fails, the cache is reused and nothing enters it."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.engine import Engine, InvalidRequest, SamplingParams
from peer.engine.verify import (
    BF16_LOGITS_GAP,
    GREEDY_MAX_LOGPROB_GAP,
    SAMPLED_MIN_LOGPROB,
    SEEDED_MAX_SCORE_GAP,
    accepted_fraction,
    check_logits,
    check_structure,
    greedy_gaps,
    seeded_gaps,
    tolerance,
)


def prompt(n, start=100):
    return [start + 7 * i % 5000 for i in range(n)]


def logprobs_at(model, tokens, temperature=1.0):
    """Log-probabilities of the next token after `tokens`, computed without the engine."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 49151), min_size=1, max_size=60),
    n_out=st.integers(1, 24),
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([0.3, 0.8, 0.95, 1.0]),
    seed=st.integers(0, 2**32),
    warm=st.booleans(),
)
def test_honest_outputs_verify(tiny_engine_factory, tokens, n_out, temperature, top_p, seed,
                               warm):
    """Greedy and sampled answers of the same model pass, cached prompt or not."""
    import trio

    params = SamplingParams(max_new_tokens=n_out, temperature=temperature, top_p=top_p, seed=seed)
    server = tiny_engine_factory()
    checker = tiny_engine_factory()

    async def run():
        done = await server.generate(tokens, params)
        if warm:
            await checker.generate(tokens, SamplingParams(max_new_tokens=1))
        return done, await checker.verify(tokens, list(done.token_ids), params)

    done, verdict = trio.run(run)
    assert verdict.ok, verdict.detail
    assert verdict.first_bad_index is None
    assert verdict.checked_tokens == len(done.token_ids)


async def test_many_sampled_seeds_verify(tiny_engine):
    p = prompt(40)
    for seed in range(30):
        params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=seed)
        done = await tiny_engine.generate(p, params)
        verdict = await tiny_engine.verify(p, list(done.token_ids), params)
        assert verdict.ok, (seed, verdict.detail)


@pytest.mark.parametrize("index", [0, 5, 15])
async def test_a_changed_greedy_token_fails_at_its_index(tiny_engine, tiny_model, index):
    p = prompt(40)
    params = SamplingParams(max_new_tokens=16)
    out = list((await tiny_engine.generate(p, params)).token_ids)
    logp = logprobs_at(tiny_model.model, p + out[:index])
    out[index] = int(logp.argmin())  # the least likely token: far beyond the tolerance
    verdict = await tiny_engine.verify(p, out, params)
    assert not verdict.ok
    assert verdict.first_bad_index == index
    assert "greedy" in verdict.detail
    assert verdict.checked_tokens == index + 1


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.lists(st.floats(-30, 30), min_size=5, max_size=5), min_size=1,
                  max_size=4),
    data=st.data(),
)
def test_greedy_gaps_are_the_log_probability_below_the_best(rows, data):
    logits = torch.tensor(rows)
    targets = [data.draw(st.integers(0, 4)) for _ in rows]
    gaps = greedy_gaps(logits, targets)
    logp = torch.log_softmax(logits.double(), dim=-1)
    for r, t in enumerate(targets):
        assert gaps[r] >= 0
        assert abs(float(gaps[r]) - float(logp[r].max() - logp[r, t])) < 1e-4
        if float(logits[r, t]) == float(logits[r].max()):
            assert gaps[r] == 0


def test_formats_with_bfloat16_logits_get_the_wider_tolerances():
    assert tolerance("float32") == (GREEDY_MAX_LOGPROB_GAP, SEEDED_MAX_SCORE_GAP)
    for fmt in ("bfloat16", "int8", "int4"):
        slack = tolerance(fmt)
        assert slack.greedy == slack.seeded == BF16_LOGITS_GAP > GREEDY_MAX_LOGPROB_GAP
        assert BF16_LOGITS_GAP > SEEDED_MAX_SCORE_GAP
    logits = torch.tensor([[10.0, 10.0 - 0.3, 0.0]])
    params = SamplingParams(max_new_tokens=1)
    assert check_logits(logits, [1], params) is not None  # 0.3 below: past 0.1
    assert check_logits(logits, [1], params, slack=tolerance("int4")) is None
    assert check_logits(logits, [2], params, slack=tolerance("int4")) is not None


async def test_a_near_tie_is_tolerated(tiny_engine, tiny_model):
    """A second-best token within GREEDY_MAX_LOGPROB_GAP of the best passes; beyond it fails."""
    p = prompt(40)
    params = SamplingParams(max_new_tokens=1)
    logp = logprobs_at(tiny_model.model, p)
    top2 = torch.topk(logp, 2)
    gap = float(top2.values[0] - top2.values[1])
    verdict = await tiny_engine.verify(p, [int(top2.indices[1])], params)
    assert verdict.ok == (gap <= GREEDY_MAX_LOGPROB_GAP)
    assert (await tiny_engine.verify(p, [int(top2.indices[0])], params)).ok


async def test_an_unlikely_token_fails_the_unseeded_check(tiny_engine, tiny_model):
    """Without a seed (a caller outside the swarm) only the statistical check is left."""
    p = prompt(40)
    params = SamplingParams(max_new_tokens=8, temperature=0.3, seed=1)
    out = list((await tiny_engine.generate(p, params)).token_ids)
    logp = logprobs_at(tiny_model.model, p + out[:3], temperature=0.3)
    out[3] = int(logp.argmin())
    assert float(logp.min()) < SAMPLED_MIN_LOGPROB  # the premise: the floor can catch it
    verdict = await tiny_engine.verify(p, out, dataclasses.replace(params, seed=None))
    assert (verdict.ok, verdict.first_bad_index) == (False, 3)
    assert "below the floor" in verdict.detail


@pytest.mark.parametrize("index", [0, 3])
async def test_a_likely_token_the_seed_did_not_select_fails(tiny_engine, tiny_model, index):
    """The steerer's move: a plausible token (here the most likely one, or the runner-up by
    perturbed score) in place of the seed's. The old nucleus check accepted both."""
    p = prompt(40)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=11)
    out = list((await tiny_engine.generate(p, params)).token_ids)
    with torch.inference_mode():
        logits = tiny_model.model(input_ids=torch.tensor([p + out[:index]])).logits[0, -1:]
    gaps, chosen = seeded_gaps(logits, params, len(p) + index)
    assert int(chosen[0]) == out[index]  # the sampler and the verifier agree on the seed's token
    runner_up = int(torch.topk(-gaps[0], 2).indices[1])
    for steered in {runner_up, int(logits[0].argmax())} - {out[index]}:
        bad = [*out[:index], steered, *out[index + 1:]]
        verdict = await tiny_engine.verify(p, bad, params)
        assert verdict.ok == (float(gaps[0, steered]) <= SEEDED_MAX_SCORE_GAP)
        if not verdict.ok:
            assert verdict.first_bad_index == index
            assert "is not the one seed 11 selects" in verdict.detail
    assert check_logits(logits, out[index:index + 1], params, 0, len(p) + index) is None


async def test_a_token_outside_the_nucleus_fails(tiny_engine, tiny_model):
    p = prompt(40)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.2, seed=1)
    out = list((await tiny_engine.generate(p, params)).token_ids)
    logp = logprobs_at(tiny_model.model, p + out[:2])
    order = torch.argsort(logp, descending=True)
    out[2] = int(order[len(order) // 2])  # a median token: above the floor, outside top 20%
    verdict = await tiny_engine.verify(p, out, params)
    assert (verdict.ok, verdict.first_bad_index) == (False, 2)
    assert "nucleus" in verdict.detail


def other_model(tiny_model, seed):
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_model.model.config)
    model.eval()
    return dataclasses.replace(tiny_model, model=model)


async def test_another_models_output_fails(tiny_engine, tiny_model):
    liar = Engine.from_model(other_model(tiny_model, 7), cache_bytes=1 << 20)
    for start in (100, 900, 4000):
        p = prompt(33, start)
        for params in (SamplingParams(max_new_tokens=16),
                       SamplingParams(max_new_tokens=16, temperature=0.3, seed=start)):
            out = list((await liar.generate(p, params)).token_ids)
            verdict = await tiny_engine.verify(p, out, params)
            assert not verdict.ok, (start, params)


async def test_structure_lies_fail(tiny_engine_factory, tiny_model):
    eos = 7
    engine = Engine.from_model(dataclasses.replace(tiny_model, eos_token_ids=(eos,)), 1 << 20)
    p = prompt(20)
    greedy = SamplingParams(max_new_tokens=4)
    out = list((await engine.generate(p, greedy)).token_ids)
    assert eos not in out  # the premise of the next checks
    too_long = await engine.verify(p, [*out, 1], SamplingParams(max_new_tokens=4))
    assert (too_long.ok, too_long.first_bad_index) == (False, 4)
    short = await engine.verify(p, out[:2], greedy)
    assert (short.ok, short.first_bad_index) == (False, 2)
    assert "without an end-of-sequence" in short.detail
    after_eos = await engine.verify(p, [out[0], eos, out[1]], greedy)
    assert (after_eos.ok, after_eos.first_bad_index) == (False, 2)
    empty = await engine.verify(p, [], greedy)
    assert (empty.ok, empty.first_bad_index) == (False, 0)
    outside = await engine.verify(p, [out[0], 10**9], greedy)
    assert (outside.ok, outside.first_bad_index) == (False, 1)


def test_stop_strings_must_end_the_output(tiny_model):
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731  token i -> a letter
    params = SamplingParams(max_new_tokens=8, stop=("cd",))
    assert check_structure([0, 1, 2, 3], params, 26, (), decode) is None  # "abcd": ends at stop
    late = check_structure([2, 3, 4, 5], params, 26, (), decode)  # "cdef": 2 tokens too many
    assert late is not None and late.index == 2
    cut = check_structure([0, 1], params, 26, (), decode)  # "ab": neither stop nor length
    assert cut is not None and cut.index == 2
    assert check_structure([0] * 8, params, 26, (), decode) is None  # length reached


async def test_verify_reuses_the_cache_and_adds_nothing_to_it(tiny_engine, tiny_model):
    p = prompt(40)  # 2 full blocks
    params = SamplingParams(max_new_tokens=24)
    out = list((await tiny_engine.generate(p, params)).token_ids)
    assert tiny_engine.local_match_tokens(p + out) == 32
    logp = logprobs_at(tiny_model.model, p + out[:2])
    bad = [*out[:2], int(logp.argmin()), *out[3:]]
    verdict = await tiny_engine.verify(p, bad, params)
    assert (verdict.ok, verdict.cached_tokens) == (False, 32)
    verdict = await tiny_engine.verify(p, out, params)
    assert (verdict.ok, verdict.cached_tokens) == (True, 32)
    assert tiny_engine.local_match_tokens(p + out) == 32  # verified output is not cached
    stats = tiny_engine.statistics()
    assert (stats["verifications"], stats["verifications_failed"]) == (2, 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_verification_leaves_no_trace_a_summary_could_show(tiny_engine_factory,
                                                                 temperature):
    """An entry's summary is its cache: a verified answer must not change it, or the
    serving peer would learn which of its answers were checked."""
    p = prompt(40)
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3)
    out = list((await tiny_engine_factory().generate(p, params)).token_ids)
    entry = tiny_engine_factory()
    entry.cache.drain_events()
    assert (await entry.verify(p, out, params)).ok
    assert entry.cache.num_blocks == 0
    assert list(entry.cache.cached_hashes()) == []
    assert entry.cache.drain_events() == []


async def test_long_outputs_verify_in_chunks(tiny_engine, tiny_model):
    p = prompt(300)
    params = SamplingParams(max_new_tokens=600)
    out = list((await tiny_engine.generate(p, params)).token_ids)
    verdict = await tiny_engine.verify(p, out, params)
    assert verdict.ok and verdict.checked_tokens == 600
    out[550] = int(logprobs_at(tiny_model.model, p + out[:550]).argmin())
    verdict = await tiny_engine.verify(p, out, params)
    assert (verdict.ok, verdict.first_bad_index) == (False, 550)


async def test_bad_prompt_or_params_are_invalid_requests(tiny_engine):
    with pytest.raises(InvalidRequest):
        await tiny_engine.verify([], [1], SamplingParams())
    with pytest.raises(InvalidRequest):
        await tiny_engine.verify([1, 2], [1], SamplingParams(temperature=-1))
    assert (await tiny_engine.verify([1, 2], ["x"], SamplingParams(max_new_tokens=1))).ok is False


def test_bench_verify_runs_and_reports(tmp_path):
    """The benchmark's command, shrunk to tiny-random: honest answers pass, a lie is caught."""
    import json

    from bench import verify as bench_verify

    out = tmp_path / "verify.json"
    args = ["--json", str(out), "--model", "tiny-random", "--runs", "1",
            "--prompt-tokens", "64", "--answer-tokens", "4"]
    assert bench_verify.main(args) == 0
    result = json.loads(out.read_text())
    for mode in ("greedy", "sampled"):
        assert result[mode]["honest_all_verified"] and result[mode]["tampered_caught"]
        assert result[mode]["answer_tokens"] == 4
        assert result[mode]["verify_cached_s"] > 0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    scale=st.sampled_from([0.5, 3.0, 12.0]),
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    top_p=st.sampled_from([0.5, 0.9, 1.0]),
    sampler_seed=st.none() | st.integers(0, 2**63 - 1),
    position=st.integers(0, 10_000),
)
def test_accepted_fraction_counts_what_check_logits_accepts(seed, scale, temperature, top_p,
                                                            sampler_seed, position):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 40, generator=gen) * scale
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=sampler_seed)
    accepted = sum(check_logits(logits, [tok], params, 0, position) is None for tok in range(40))
    assert float(accepted_fraction(logits, params, position)[0]) * 40 == pytest.approx(accepted)
    if temperature > 0 and sampler_seed is not None:
        assert accepted >= 1  # the seed's own token always passes


def test_a_verification_is_cut_into_chunks_over_the_cached_prefix() -> None:
    """What a re-score feeds (peer/engine/verify_plan.py): the prompt and all but the last
    output token, from the end of the cached prefix, VERIFY_CHUNK_TOKENS at a time."""
    from peer.engine.verify_plan import VERIFY_CHUNK_TOKENS, verify_chunks

    assert verify_chunks(600, 3, 0) == [(256, 0), (256, 256), (90, 512)]
    assert verify_chunks(600, 3, 512) == [(90, 512)]
    assert verify_chunks(10, 1, 0) == [(10, 0)]
    assert verify_chunks(10, 0, 0) == [(10, 0)]
    assert verify_chunks(600, 3, 0, chunk_tokens=1000) == [(602, 0)]
    assert sum(n for n, _ in verify_chunks(5000, 17, 48)) == 5000 + 16 - 48
    assert VERIFY_CHUNK_TOKENS == 256
    for bad in ((10, 1, 10), (-1, 1, 0), (10, 1, -1)):
        with pytest.raises(ValueError):
            verify_chunks(*bad)
