"""The seeded sampler (peer/engine/sampling.py): its hash is the documented one, its draws
follow the top_p distribution, and the engine's sampled tokens depend only on (seed,
position), not on the batch, the chunking of the prompt, the cache or a handover."""

import dataclasses
import math
import random

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.api import SamplingParams
from peer.engine.sampling import (
    _hash32_rows,
    gumbel_noise,
    hash32,
    nucleus_masks,
    sample_seeded,
    token_key,
)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 2**20),
       tokens=st.lists(st.integers(0, 49151), min_size=1, max_size=8))
def test_vectorised_hash_equals_the_reference(seed, position, tokens):
    rows = _hash32_rows(seed, [position, position + 1], 49152)
    for t in tokens:
        assert int(rows[0, t]) == hash32(seed, position, t)
        assert int(rows[1, t]) == hash32(seed, position + 1, t)
        assert 0 <= hash32(seed, position, t) < 2**32


def test_the_hash_is_a_permutation_of_tokens_and_keys_differ():
    rows = _hash32_rows(5, [0, 1], 1 << 16)
    assert len(set(rows[0].tolist())) == 1 << 16  # no two tokens share a noise value
    assert token_key(5, 0) != token_key(5, 1) and token_key(5, 0) != token_key(6, 0)
    assert (rows[0] != rows[1]).float().mean() > 0.99
    with pytest.raises(ValueError):
        token_key(-1, 0)


def test_noise_is_uniform_and_gumbel():
    """Bits and noise look right: a chi-square over 16 buckets of u, and the Gumbel's
    mean (Euler's gamma) and variance (pi^2 / 6)."""
    bits = _hash32_rows(123, range(64), 4096)  # 262,144 values
    counts = torch.bincount((bits >> 28).flatten(), minlength=16).double()
    expected = bits.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40  # 15 degrees of freedom: p < 0.001 above 37.7
    g = gumbel_noise(123, range(64), 4096)
    assert abs(float(g.mean()) - 0.5772) < 0.01
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.02


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
def test_draws_follow_the_nucleus_distribution(temperature, top_p):
    """Over many positions, the sampler picks each token of an 8-token vocabulary as often
    as top_p sampling would (chi-square), and never one outside the nucleus."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    keep = nucleus_masks(logits[None], temperature, top_p)[0]
    want = probs * keep / (probs * keep).sum()
    n = 6000
    picks = [sample_seeded(logits, temperature, top_p, 99, pos) for pos in range(n)]
    counts = torch.bincount(torch.tensor(picks), minlength=8).double()
    assert counts[~keep].sum() == 0
    inside = want > 0
    chi2 = float(((counts[inside] - n * want[inside]) ** 2 / (n * want[inside])).sum())
    assert chi2 < 25  # at most 7 degrees of freedom: p < 0.001 above 24.3


def test_nucleus_masks_keep_the_top_token_and_the_cut():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert nucleus_masks(logits, 1.0, 0.6)[0].tolist() == [True, True, False, False]
    assert nucleus_masks(logits, 1.0, 0.5)[0].tolist() == [True, False, False, False]
    assert nucleus_masks(logits, 1.0, -0.1)[0].tolist() == [True, False, False, False]
    assert nucleus_masks(logits, 1.0, 1.0)[0].all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 10**6),
       scale=st.floats(0.1, 20.0), temperature=st.floats(0.05, 2.0))
def test_the_draw_depends_only_on_seed_position_and_logits(seed, position, scale, temperature):
    gen = torch.Generator().manual_seed(position % 1000)
    logits = torch.randn(300, generator=gen) * scale
    one = sample_seeded(logits, temperature, 1.0, seed, position)
    assert one == sample_seeded(logits.clone(), temperature, 1.0, seed, position)
    assert one == sample_seeded(logits.double(), temperature, 1.0, seed, position)


# -- the engine ------------------------------------------------------------------------------


def prompts(n, rng):
    return [[rng.randrange(49152) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


@settings(max_examples=6, deadline=None)
@given(step_tokens=st.integers(1, 48), max_running=st.integers(1, 6),
       rng=st.randoms(use_true_random=False))
def test_sampled_tokens_do_not_depend_on_the_batch(tiny_engine_factory, step_tokens,
                                                   max_running, rng):
    """Each request alone on an uncached engine, and all at once on a batching engine with
    chunked prefill: the same tokens (the noise is keyed by seed and position only)."""
    ps = prompts(5, rng)
    params = [SamplingParams(max_new_tokens=6, temperature=rng.choice([0.5, 1.0, 1.3]),
                             top_p=rng.choice([0.8, 1.0]), seed=rng.randrange(2**40))
              for _ in ps]
    alone = tiny_engine_factory(cache_bytes=0)
    batched = tiny_engine_factory()
    batched.step_tokens, batched.max_running = step_tokens, max_running

    async def run():
        want = [(await alone.generate(p, q)).token_ids for p, q in zip(ps, params, strict=True)]
        got = {}

        async def one(i):
            got[i] = (await batched.generate(ps[i], params[i])).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(ps)):
                nursery.start_soon(one, i)
        assert [got[i] for i in range(len(ps))] == want

    trio.run(run)


async def test_a_handover_continues_the_same_draw(tiny_engine):
    """Prompt + the first k tokens, asked for the rest, gives the rest: keys are positions
    in prompt + output, so a fallback peer continues the seed's answer."""
    p = prompts(1, random.Random(4))[0]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2024)
    whole = list((await tiny_engine.generate(p, params)).token_ids)
    rest = await tiny_engine.generate(p + whole[:4], dataclasses.replace(params,
                                                                         max_new_tokens=6))
    assert list(rest.token_ids) == whole[4:]


async def test_an_unseeded_request_is_drawn_with_a_fresh_seed(tiny_engine):
    p = prompts(1, random.Random(5))[0]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    tiny_engine.seed_rng.seed(1)
    a = (await tiny_engine.generate(p, params)).token_ids
    tiny_engine.seed_rng.seed(1)
    assert (await tiny_engine.generate(p, params)).token_ids == a
    assert (await tiny_engine.generate(p, params)).token_ids != a  # 12 draws at T = 1


async def test_greedy_is_unchanged(tiny_engine, tiny_model):
    p = prompts(1, random.Random(6))[0]
    out = (await tiny_engine.generate(p, SamplingParams(max_new_tokens=5))).token_ids
    ids = list(p)
    with torch.inference_mode():
        for tok in out:
            assert int(tiny_model.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) \
                == tok
            ids.append(tok)


def test_bench_sampling_runs_and_reports(tmp_path):
    """The measurement's command, shrunk to tiny-random and float32: honest answers pass
    under both batch shapes, and steered tokens are (almost) never accepted."""
    import json

    from bench import sampling as bench_sampling

    out = tmp_path / "sampling.json"
    assert bench_sampling.main(["--json", str(out), "--model", "tiny-random", "--dtypes",
                                "float32", "--answers", "2", "--answer-tokens", "4",
                                "--prompt-tokens", "40"]) == 0
    rows = json.loads(out.read_text())["dtypes"]["float32"]
    for key in ("t1.0_p1.0", "t0.7_p0.9"):
        row = rows[key]
        assert row["honest_accepted"] == 1.0 and row["positions"] == 16
        assert row["batch_identical_answers"] == 2
        assert row["steer_false_accept"] < 0.5
    assert rows["t1.0_p1.0"]["unseeded_accepted_fraction_mean"] > 0.5  # the old room
