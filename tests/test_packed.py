"""bfloat16 layers laid out once for oneDNN: the same bits as F.linear at any row count,
the plain weight back in the state dict (so the model id's fingerprint holds), and a
packed model serving what transformers computes on it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.engine.engine import Engine
from peer.engine.model import load_model, weights_fingerprint
from peer.engine.packed import PackedLinear, pack_linears, packing_available
from protocols.ids import split_model_id
from tests.helpers_engine import assert_serves_like_transformers

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_a_packed_layer_computes_f_linear_bit_for_bit(rows, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(2, rows, 64, generator=gen).to(torch.bfloat16)
    layer = PackedLinear(weight, b)
    with torch.inference_mode():
        got = layer(x)
        want = torch.nn.functional.linear(x, weight, b)
    assert got.shape == want.shape == (2, rows, 96)
    assert torch.equal(got, want)


def test_a_packed_layer_gives_its_plain_weight_back():
    weight = torch.randn(48, 32).to(torch.bfloat16)
    layer = PackedLinear(weight, None)
    assert torch.equal(layer.weight, weight)
    assert set(layer.state_dict()) == {"weight"}
    assert torch.equal(layer.state_dict()["weight"], weight)
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(weight.float(), None)


def test_a_bfloat16_model_is_packed_keeping_its_fingerprint():
    loaded = load_model("tiny-random", dtype="bfloat16")
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert layers and not any(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    assert split_model_id(loaded.model_id)[2] == weights_fingerprint(loaded.model)
    unpacked = load_model("tiny-random", dtype="float32")
    assert pack_linears(unpacked.model) == 0  # float32 layers stay as they are


async def test_a_packed_model_serves_what_transformers_computes_on_it():
    loaded = load_model("tiny-random", dtype="bfloat16")
    assert isinstance(loaded.model.lm_head, PackedLinear)
    engine = Engine(loaded, cache_bytes=1_000_000, block_size=16)
    await assert_serves_like_transformers(engine, loaded.model,
                                          [100 + 7 * i % 5000 for i in range(40)])
