"""Weight-only int8 and int4: the quantizers' rounding, the layers against their own
dequantized weights, and the engine on quantized weights serving exactly what the same
quantized model computes one request at a time (batched, chunked and cached alike)."""

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine import quant
from peer.engine.api import QUANT_FORMATS, SamplingParams
from peer.engine.engine import Engine
from peer.engine.model import ModelLoadError, load_model
from peer.engine.quant import (
    ACTIVATION_DTYPE,
    FusedProjections,
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from protocols.ids import split_model_id
from tests.helpers_engine import assert_greedy_equal_up_to_ties, assert_serves_like_transformers

GREEDY4 = SamplingParams(max_new_tokens=4)


def prompt(n, start=100):
    return [start + 7 * i % 5000 for i in range(n)]


def dequant_int4(q, scales_and_zeros, group=32):
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, K / group, 2]
    w = (q.float().reshape(n, k // group, group) - 8) * sz[..., :1] + sz[..., 1:]
    return w.reshape(n, k)


def test_int8_rounds_each_weight_to_the_nearest_step_of_its_channel():
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 48)[:, None]
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == ACTIVATION_DTYPE
    err = (q.float() * scales.float()[:, None] - w).abs()
    assert (err <= scales.float()[:, None] / 2 * 1.001).all()
    assert q.abs().amax(dim=1).min() >= 126  # the range is used


def test_int4_gives_back_the_4bit_values_of_q4_1_blocks():
    """A GGUF Q4_1 block is w = q * d + m over 32 weights (q in 0..15): quantizing the
    dequantized floats finds the same q (scales rounded to bfloat16 or not)."""
    gen = torch.Generator().manual_seed(7)
    n, k = 32, 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    q[:, ::32], q[:, 1::32] = 0, 15  # every block spans the full range, as Q4_1 makes it
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.05 + 1e-3
    m = -torch.rand(n, k // 32, 1, generator=gen) * 0.4
    w = (q.float().reshape(n, k // 32, 32) * d + m).reshape(n, k)
    got, scales_and_zeros = quantize_int4(w)
    assert torch.equal(got, q)
    # the values differ only by the scale and zero rounded to bfloat16 (8 bits of mantissa)
    sz = scales_and_zeros.float().transpose(0, 1).repeat_interleave(32, dim=1)
    bound = 2**-8 * (15 * sz[..., 0] + sz[..., 1].abs())
    assert ((dequant_int4(got, scales_and_zeros) - w).abs() <= bound).all()


def test_int4_of_random_weights_stays_within_half_a_step():
    w = torch.randn(64, 96)
    q, scales_and_zeros = quantize_int4(w)
    assert q.min() >= 0 and q.max() <= 15
    step = scales_and_zeros[..., 0].float().transpose(0, 1).repeat_interleave(32, dim=1)
    assert ((dequant_int4(q, scales_and_zeros) - w).abs() <= step * 0.55).all()


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
def test_the_layers_compute_x_times_their_dequantized_weights(layer):
    torch.manual_seed(3)
    w, b = torch.randn(32, 64) * 0.1, torch.randn(32)
    lin = layer(w, b)
    if layer is Int8Linear:
        deq = lin.weight_int8.float() * lin.scales.float()[:, None]
    else:
        deq = dequant_int4(quantize_int4(w)[0], lin.scales_and_zeros)
    x = torch.randn(2, 5, 64).to(ACTIVATION_DTYPE)
    want = x.float() @ deq.T + b.to(ACTIVATION_DTYPE).float()
    got = lin(x)
    assert got.shape == (2, 5, 32) and got.dtype == ACTIVATION_DTYPE
    assert torch.allclose(got.float(), want, atol=0.05, rtol=0.02)
    assert not torch.allclose(got.float(), x.float() @ w.T * 0, atol=0.05)  # not trivially 0


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
def test_fused_projections_compute_exactly_their_parts_in_shared_memory(layer):
    torch.manual_seed(5)
    sizes = (128, 64, 192) if layer is Int4Linear else (48, 16, 32)
    parts = [layer(torch.randn(n, 64) * 0.1, None) for n in sizes]
    x = torch.randn(7, 64).to(ACTIVATION_DTYPE)
    before = [part(x) for part in parts]
    fused = FusedProjections(parts)
    for rows, want in ((x[:1], [ref[:1] for ref in before]), (x, before),
                       (x.view(1, 7, 64), [ref.view(1, 7, -1) for ref in before])):
        got = fused(rows)
        assert [out.shape[-1] for out in got] == list(sizes)
        for part, out, ref in zip(parts, got, want, strict=True):
            assert torch.equal(out, ref)  # bit for bit: each channel is computed on its own
            assert torch.equal(part(rows), ref)  # the parts, now views, compute the same
    weight = "packed" if layer is Int4Linear else "weight_int8"
    storage = fused.weight.untyped_storage().data_ptr()
    assert all(getattr(p, weight).untyped_storage().data_ptr() == storage for p in parts)


def test_only_alike_bias_free_projections_of_one_input_fuse():
    w = torch.randn(32, 64) * 0.1
    with pytest.raises(ValueError, match="Int4Linear or Int8Linear"):
        FusedProjections([Int4Linear(w, None), Int8Linear(w, None)])
    with pytest.raises(ValueError, match="bias"):
        FusedProjections([Int8Linear(w, torch.zeros(32)), Int8Linear(w, None)])
    with pytest.raises(ValueError, match="input sizes"):
        FusedProjections([Int8Linear(w, None), Int8Linear(torch.randn(32, 96), None)])
    with pytest.raises(ValueError, match="two or more"):
        FusedProjections([Int8Linear(w, None)])
    with pytest.raises(ValueError, match="blocks of 64"):  # the kernel's packing would not slice
        FusedProjections([Int4Linear(torch.randn(64, 64), None), Int4Linear(w, None)])


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_fusing_leaves_the_weights_and_so_the_model_id_unchanged(fmt, monkeypatch):
    """The fingerprint hashes the state dict: fusion must neither add to it nor change it."""
    fused_model = load_model("tiny-random", device="cpu").model
    counts = quantize_model(fused_model, fmt)
    layers = fused_model.config.num_hidden_layers
    # tiny-random's k and v have 32 outputs: in int4 only gate and up fuse
    assert counts["FusedProjections"] == (layers if fmt == "int4" else 2 * layers)
    monkeypatch.setattr(quant, "fuse_projections", lambda model: 0)
    plain_model = load_model("tiny-random", device="cpu").model
    quantize_model(plain_model, fmt)
    fused_state, plain_state = fused_model.state_dict(), plain_model.state_dict()
    assert list(fused_state) == list(plain_state)
    assert all(torch.equal(fused_state[k], plain_state[k]) for k in plain_state)


@pytest.fixture(scope="module", params=QUANT_FORMATS)
def quant_model(request):
    return load_model("tiny-random", dtype=request.param, device="cpu")


async def test_quantized_model_serves_with_reuse_and_matches_its_own_generate(quant_model):
    name, fmt, fingerprint = split_model_id(quant_model.model_id)
    assert (name, fmt) == ("tiny-random", fmt) and fmt in QUANT_FORMATS and len(fingerprint) == 12
    model = quant_model.model
    layers = [type(m).__name__ for m in model.modules()]
    assert "Linear" not in layers  # every nn.Linear swapped
    assert type(model.lm_head) is Int8Linear  # the head stays 8-bit in both formats
    want = Int4Linear if fmt == "int4" else Int8Linear
    assert type(model.model.layers[0].mlp.down_proj) is want
    assert model.model.embed_tokens.weight.dtype == ACTIVATION_DTYPE
    engine = Engine.from_model(quant_model)
    assert engine.layout.itemsize == 2  # bfloat16 KV
    await assert_serves_like_transformers(engine, model, prompt(40))


def test_formats_have_their_own_ids(quant_model, tiny_model):
    assert split_model_id(quant_model.model_id)[2] != split_model_id(tiny_model.model_id)[2]
    again = load_model("tiny-random", dtype=split_model_id(quant_model.model_id)[1])
    assert again.model_id == quant_model.model_id  # deterministic: peers agree


def test_quantized_formats_are_cpu_only():
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            load_model("tiny-random", dtype="int8", device="cuda")


@settings(max_examples=6, deadline=None)
@given(
    shared=st.lists(st.integers(0, 49151), min_size=16, max_size=60),
    tails=st.lists(
        st.tuples(st.integers(0, 60), st.lists(st.integers(0, 49151), min_size=1, max_size=20)),
        min_size=2, max_size=5,
    ),
    step_tokens=st.integers(1, 48),
    budget_blocks=st.integers(1, 6),
)
def test_batched_cached_quantized_generation_equals_one_at_a_time(
    quant_model, shared, tails, step_tokens, budget_blocks
):
    """Prompts sharing prefixes, all at once, chunked and through an evicting cache:
    greedy tokens equal an uncached engine's on the same quantized weights, one request
    at a time, up to near-ties of the bfloat16 logits (a step of bfloat16 at the logits'
    size is 1/32 here; the tolerance allows two)."""
    prompts = [shared[:cut] + tail for cut, tail in tails] * 2
    reference = Engine.from_model(quant_model, cache_bytes=0)
    batched = Engine.from_model(
        quant_model, cache_bytes=budget_blocks * reference.layout.block_bytes)
    batched.step_tokens = step_tokens

    async def run():
        want = [(await reference.generate(p, GREEDY4)).token_ids for p in prompts]
        got = [None] * len(prompts)

        async def one(i):
            got[i] = (await batched.generate(prompts[i], GREEDY4)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        for p, g, w in zip(prompts, got, want, strict=True):
            assert_greedy_equal_up_to_ties(quant_model.model, p, g, w, tolerance=1 / 16)

    trio.run(run)
    assert batched.statistics()["max_batch"] >= 2


def test_batching_alone_is_bit_for_bit_in_the_quantized_formats(quant_model):
    """Prompts read whole in one packed step and then decoded together get exactly the
    logits each gets alone: the int4 and int8 products compute every row on its own, and
    attention runs per sequence. (Reading a prompt in chunks, or after cached tokens, is
    bit for bit only with the fixed-order attention: next test.)"""
    runner = Engine.from_model(quant_model, cache_bytes=0).runner
    prompts = [prompt(23), prompt(40, start=900), prompt(7, start=3000)]

    def decode(together: bool) -> list[list[torch.Tensor]]:
        kvs = [runner.new_kv([], len(p) + 4) for p in prompts]
        feeds = [list(p) for p in prompts]
        seen: list[list[torch.Tensor]] = [[] for _ in prompts]
        for _ in range(4):
            if together:
                rows = list(runner.forward(list(zip(kvs, feeds, strict=True)), [1] * len(kvs)))
            else:
                rows = [runner.forward([(kv, feed)], [1])[0] for kv, feed in zip(kvs, feeds,
                                                                                 strict=True)]
            for i, row in enumerate(rows):
                seen[i].append(row)
                feeds[i] = [int(row.argmax())]
        return seen

    alone, together = decode(False), decode(True)
    for one, packed in zip(alone, together, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(one, packed, strict=True))


def test_chunks_and_cached_tokens_are_bit_for_bit_with_the_fixed_order_attention(quant_model):
    """The quantized formats load with the fixed-order attention (attention auto), so a
    prompt read in chunks, partly from copied cache blocks, then decoded beside another
    sequence, gets exactly the logits of the prompt read whole and decoded alone."""
    assert quant_model.attention == "fixed"
    runner = Engine.from_model(quant_model, cache_bytes=0).runner
    block = 16
    text = prompt(70, start=400)
    other = prompt(33, start=2000)

    def run(chunks: list[int], cached_blocks: int, beside: bool) -> list[torch.Tensor]:
        seen = []
        source = runner.new_kv([], len(text) + 4)
        runner.forward([(source, text[: cached_blocks * block])], [0]) if cached_blocks else None
        kv = runner.new_kv(source.blocks(0, cached_blocks, block), len(text) + 4)
        fed = cached_blocks * block
        for size in chunks:
            seen.append(runner.forward([(kv, text[fed : fed + size])], [1])[0])
            fed += size
        assert fed == len(text)
        neighbour = runner.new_kv([], len(other) + 4)
        runner.forward([(neighbour, other)], [1])
        token, other_token = int(seen[-1].argmax()), 7
        for _ in range(3):
            items = [(kv, [token]), (neighbour, [other_token])] if beside else [(kv, [token])]
            rows = runner.forward(items, [1] * len(items))
            seen.append(rows[0])
            token = int(rows[0].argmax())
        return [seen[len(chunks) - 1], *seen[len(chunks):]]

    whole = run([len(text)], 0, beside=False)
    for chunks, cached in (([13, 1, 40, 16], 0), ([5, 1, 32], 2), ([1] * 6, 4)):
        got = run(chunks, cached, beside=True)
        assert all(torch.equal(a, b) for a, b in zip(whole, got, strict=True)), (chunks, cached)
