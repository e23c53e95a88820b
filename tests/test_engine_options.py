"""--dtype, --device, --threads: float32 and bfloat16 both serve on this CPU, the dtype is
part of the model id (so caches of different precision are never shared), bad values are
clear errors."""

import pytest
import torch

from peer import cli
from peer.config import PeerConfig
from peer.engine.engine import Engine
from peer.engine.model import ModelLoadError, load_model, resolve_device
from protocols.ids import split_model_id
from tests.helpers_engine import assert_serves_like_transformers


def prompt(n, start=100):
    return [start + 7 * i % 5000 for i in range(n)]


@pytest.fixture(scope="module")
def bf16_model():
    return load_model("tiny-random", dtype="bfloat16", device="cpu")


async def test_bfloat16_serves_with_reuse_and_matches_transformers(bf16_model):
    assert split_model_id(bf16_model.model_id)[:2] == ("tiny-random", "bfloat16")
    assert next(bf16_model.model.parameters()).dtype == torch.bfloat16
    engine = Engine.from_model(bf16_model)
    assert engine.layout.itemsize == 2 and engine.hasher.model_id == bf16_model.model_id
    await assert_serves_like_transformers(engine, bf16_model.model, prompt(40))


def test_the_model_id_names_the_dtype_unless_float32_and_the_weights(tiny_model, tiny_engine,
                                                                     bf16_model):
    _, _, fingerprint = split_model_id(tiny_model.model_id)
    assert tiny_model.model_id == f"tiny-random+w{fingerprint}" and len(fingerprint) == 12
    assert split_model_id(bf16_model.model_id)[2] != fingerprint  # other bytes, other id
    assert tiny_engine.layout.itemsize == 4
    # the two precisions hash the same tokens to different blocks: never shared
    from protocols.blocks import BlockHasher

    tokens = prompt(32)
    assert BlockHasher("tiny-random", 16).chain(tokens) != BlockHasher(
        "tiny-random@bfloat16", 16
    ).chain(tokens)


def test_bad_precision_and_device_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="float16 is not supported on the CPU"):
        load_model("tiny-random", dtype="float16", device="cpu")
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model("tiny-random", dtype="int3")
    with pytest.raises(ModelLoadError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            resolve_device("cuda")
        assert resolve_device("auto") in ("cpu", "mps")
    with pytest.raises(ModelLoadError, match="threads"):
        load_model("tiny-random", threads=0)


def test_cli_flags_reach_the_config():
    args = cli.build_parser().parse_args(
        ["serve", "--dtype", "bfloat16", "--device", "cpu", "--threads", "2", "--identity", ""]
    )
    config = cli.config_from_args(args)
    assert (config.dtype, config.device, config.threads) == ("bfloat16", "cpu", 2)
    assert PeerConfig().dtype == "float32" and PeerConfig().device == "auto"
    with pytest.raises(ValueError, match="dtype"):
        PeerConfig(dtype="float8")
    with pytest.raises(ValueError, match="threads"):
        PeerConfig(threads=0)
