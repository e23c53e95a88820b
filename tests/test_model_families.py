"""Models beyond the embedded one: a checkpoint folder of another family (Qwen2) serves
with prefix reuse and matches transformers; the model id fingerprints the weights, so two
folders named alike with other weights are different models, and their peers refuse each
other with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from peer.engine.embedded import TINY_CONFIG
from peer.engine.engine import Engine
from peer.engine.model import ModelLoadError, load_model
from protocols.ids import split_model_id
from tests.helpers_engine import assert_serves_like_transformers

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen2")


def make_checkpoint(folder: Path, family: str, tokenizer: Any, seed: int) -> Path:
    """A tiny random checkpoint of `family` with the SmolLM2 tokenizer, saved in `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]  # fmt: skip
    config = config_cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=None, pad_token_id=tokenizer.pad_token_id, **TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_checkpoint_of_each_family_serves_with_reuse_and_matches_transformers(
    tmp_path: Path, tiny_model: Any, family: str
) -> None:
    folder = make_checkpoint(tmp_path / f"tiny-{family}", family, tiny_model.tokenizer, 7)
    loaded = load_model(str(folder))
    assert type(loaded.model).__name__.lower().startswith(family)
    engine = Engine.from_model(loaded)
    tokens = [100 + 7 * i % 5000 for i in range(40)]
    await assert_serves_like_transformers(engine, loaded.model, tokens)


def test_the_fingerprint_follows_the_weights_not_the_folder(tmp_path: Path, tiny_model: Any):
    tok = tiny_model.tokenizer
    a = load_model(str(make_checkpoint(tmp_path / "a" / "model", "llama", tok, 1)))
    b = load_model(str(make_checkpoint(tmp_path / "b" / "model", "llama", tok, 2)))
    a2 = load_model(str(make_checkpoint(tmp_path / "c" / "model", "llama", tok, 1)))
    assert split_model_id(a.model_id)[0] == split_model_id(b.model_id)[0] == "model"
    assert a.model_id != b.model_id  # same name, other weights: other swarms
    assert a.model_id == a2.model_id  # same weights elsewhere: the same model


def test_model_options(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    loaded = load_model("tiny-random", max_model_len=512, chat_template=template)
    assert loaded.max_context == 512
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                tokenize=False)
    assert text == "<user>hi"
    with pytest.raises(ModelLoadError, match="this model's context is 2048 tokens"):
        load_model("tiny-random", max_model_len=4096)
    with pytest.raises(ModelLoadError, match="--revision applies to hub ids only"):
        load_model("tiny-random", revision="main")
    with pytest.raises(ModelLoadError, match="cannot read the chat template"):
        load_model("tiny-random", chat_template=tmp_path / "missing.jinja")


def _serve(model: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "serve", "--config", "none", "--identity", "none",
         "--model", str(model), "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "",
         "--report", "json", "--log-level", "warning", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.mark.slow
def test_peers_of_two_checkpoints_named_alike_refuse_each_other(tmp_path: Path, tiny_model: Any):
    tok = tiny_model.tokenizer
    first = _serve(make_checkpoint(tmp_path / "a" / "model", "llama", tok, 1))
    second = None
    try:
        assert first.stdout is not None
        up = next(e for line in first.stdout if (e := json.loads(line))["event"] == "up")
        second = _serve(make_checkpoint(tmp_path / "b" / "model", "llama", tok, 2),
                        "--bootstrap", up["multiaddrs"][0])
        _, err = second.communicate(timeout=180)
        assert second.returncode == 1, err[-2000:]
        assert f"bootstrap peer {up['peer_id'][:16]}... serves {up['model']}" in err
        assert "cannot share a swarm" in err
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
        _, first_err = first.communicate()
    assert "cannot share a swarm" in first_err  # the first peer saw it too
