"""--dtype, --device, --threads, --attention: float32 and bfloat16 both serve on this CPU,
the dtype is part of the model id (so caches of different precision are never shared),
the attention kernel is chosen at load, bad values are clear errors."""

import pytest
import torch

from peer import cli
from peer.config import PeerConfig
from peer.engine.engine import Engine
from peer.engine.model import (
    ModelLoadError,
    choose_dtype,
    cpu_flags,
    load_model,
    resolve_device,
)
from peer.engine.runner import FIXED_ATTENTION_NAME
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


def test_auto_dtype_follows_the_hardware_and_the_shipped_format(tmp_path):
    avx2 = frozenset({"avx2", "fma"})
    assert choose_dtype("smollm2-135m", "cpu", avx2)[0] == "float32"
    assert choose_dtype("smollm2-135m", "cpu", avx2 | {"avx512_bf16"})[0] == "bfloat16"
    # the embedded model runs the 4-bit format it ships in where torch's int4 kernel is fast
    assert choose_dtype("smollm2-135m", "cpu", avx2 | {"avx512_bf16"},
                        cpu_capability="AVX512")[0] == "int4"
    assert choose_dtype("smollm2-135m", "cpu", avx2 | {"avx512_bf16"},
                        cpu_capability="AVX2")[0] == "bfloat16"
    assert choose_dtype("smollm2-135m", "cpu", avx2, cpu_capability="AVX512")[0] == "float32"
    assert choose_dtype("org/model", "cpu", avx2 | {"amx_bf16"},
                        cpu_capability="AVX512")[0] == "bfloat16"
    assert choose_dtype("tiny-random", "cpu", avx2 | {"amx_bf16"},
                        cpu_capability="AVX512")[0] == "float32"
    assert choose_dtype("org/model", "cpu", avx2 | {"amx_bf16"}) == (
        "bfloat16", "this CPU has amx_bf16")
    assert choose_dtype("tiny-random", "cpu", avx2 | {"avx512_bf16"})[0] == "float32"
    assert choose_dtype("smollm2-135m", "cuda", avx2, cuda_bf16=True)[0] == "bfloat16"
    assert choose_dtype("smollm2-135m", "cuda", avx2 | {"amx_bf16"})[0] == "float32"
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_names_the_dtype_it_chose(capsys):
    loaded = load_model("tiny-random", dtype="auto", device="cpu")
    assert split_model_id(loaded.model_id)[1] == "float32"
    assert "--dtype auto: float32 (tiny-random is a test model)" in capsys.readouterr().err


async def test_the_attention_kernel_is_chosen_at_load_and_generate_uses_it():
    assert load_model("tiny-random", dtype="float32", device="cpu").attention == "sdpa"
    fixed = load_model("tiny-random", dtype="float32", device="cpu", attention="fixed")
    assert fixed.attention == "fixed"
    engine = Engine.from_model(fixed)
    assert fixed.model.config._attn_implementation == FIXED_ATTENTION_NAME  # kept by the engine
    await assert_serves_like_transformers(engine, fixed.model, prompt(40))
    with pytest.raises(ModelLoadError, match="unknown attention"):
        load_model("tiny-random", attention="flash")


def test_cli_flags_reach_the_config():
    args = cli.build_parser().parse_args(
        ["serve", "--dtype", "bfloat16", "--device", "cpu", "--threads", "2", "--identity", "",
         "--attention", "fixed"]
    )
    config = cli.config_from_args(args)
    assert (config.dtype, config.device, config.threads) == ("bfloat16", "cpu", 2)
    assert config.attention == "fixed" and PeerConfig().attention == "auto"
    with pytest.raises(ValueError, match="attention"):
        PeerConfig(attention="flash")
    assert PeerConfig().dtype == "auto" and PeerConfig().device == "auto"
    with pytest.raises(ValueError, match="dtype"):
        PeerConfig(dtype="float8")
    with pytest.raises(ValueError, match="threads"):
        PeerConfig(threads=0)


def test_int4_without_avx512_kernels_warns_at_load(monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    loaded = load_model("tiny-random", dtype="int4", device="cpu")
    assert loaded.model_id.startswith("tiny-random@int4")
    assert "int4 on this CPU (torch's AVX2 kernels, not AVX512)" in capsys.readouterr().err
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    load_model("tiny-random", dtype="int4", device="cpu")
    assert "warning" not in capsys.readouterr().err
