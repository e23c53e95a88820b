"""Weight-only quantized linear layers for the CPU, swapped in for a model's nn.Linear.

Decode on a CPU reads every weight once per step, so its speed is the bytes of weights
read: float32 4 bytes a weight, bfloat16 2, int8 1, int4 half. Two formats, both with
bfloat16 activations (the rest of the model, embeddings, norms and the KV cache, runs in
bfloat16 too; the format fixes the activation dtype so that two peers with the same model
id compute the same thing on any CPU):

  int8  every nn.Linear as int8 per output channel (symmetric, scale = max |w| / 127),
        through `torch.ops.aten._weight_int8pack_mm`.
  int4  the projections of every layer as int4 in groups of INT4_GROUP weights along the
        input (asymmetric: w = (q - 8) * scale + zero, q in 0..15) through
        `torch.ops.aten._weight_int4pack_mm_for_cpu`; the output head, and any layer whose
        shape the kernel does not take, as int8 (llama.cpp keeps its output head at 8 bits
        too). A Q4_1 GGUF's blocks are groups of 32 with a scale and a minimum: the same
        shape, so quantizing its dequantized float weights gives its 4-bit values back.

Both quantize from the float weights as loaded. Embeddings stay bfloat16.

A Llama layer's projections of one input (q, k and v; gate and up) are also held as one
fused matrix (FusedProjections), which the written-out decode step (compiled_decode.py)
calls once instead of three or two times: at batch 1 a small product costs mostly its call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .api import QUANT_FORMATS

ACTIVATION_DTYPE = torch.bfloat16
INT4_GROUP = 32  # a GGUF Q4_0/Q4_1 block
_INT4_N_MULTIPLE = 16  # the CPU kernel packs output channels by 16
_INT4_LEVELS = 15
# The CPU kernel's packing lays output channels out in blocks of 64: a fused int4 matrix's
# packing is its parts' packings one after another only where each part is whole blocks.
_INT4_PACK_BLOCK = 64


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales [N] in ACTIVATION_DTYPE): w ~ q * scale, per output channel.
    The scale is rounded to the activation dtype first, and q computed against it."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(ACTIVATION_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in 0..15, scales_and_zeros [K / group, N, 2] in ACTIVATION_DTYPE):
    w ~ (q - 8) * scale + zero per group of `group` weights along the input, scale =
    (max - min) / 15 and zero = min + 8 * scale, both rounded to the activation dtype
    before q is computed against them."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / _INT4_LEVELS).clamp_min(1e-12).to(ACTIVATION_DTYPE)
    zero = (lo + 8 * scale.float()).to(ACTIVATION_DTYPE)
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8)
    q = q.clamp(0, _INT4_LEVELS).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
    """Whether the CPU int4 kernel takes a layer of this shape."""
    return in_features % group == 0 and out_features % _INT4_N_MULTIPLE == 0


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _int8_product(flat: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
                  ) -> torch.Tensor:
    """flat [M, K] times int8 `weight` [N, K] with per-channel `scales`: [M, N]."""
    y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, weight, scales)
    return y


def _int4_product(flat: torch.Tensor, packed: torch.Tensor, group: int,
                  scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """flat [M, K] times the CPU kernel's packed int4 weight: [M, N]."""
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group,
                                                                 scales_and_zeros)
    return y


class _QuantLinear(nn.Module):
    """What both quantized layers share: y = product(x) (+ bias), in x's leading shape."""

    out_features: int
    bias: nn.Parameter | None

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(_flat(x))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(_QuantLinear):
    """y = x W^T (+ b) with W int8 per output channel; x in ACTIVATION_DTYPE."""

    weight_int8: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scales = quantize_int8(weight)
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().to(ACTIVATION_DTYPE), requires_grad=False)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return _int8_product(flat, self.weight_int8, self.scales)


class Int4Linear(_QuantLinear):
    """y = x W^T (+ b) with W int4 in groups along the input; x in ACTIVATION_DTYPE.

    The kernel's packed layout is the kernel's business (and may change with torch), so
    the state dict, which the model id's fingerprint hashes, holds a digest of the 4-bit
    values, scales and zeros instead of the packed bytes."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group: int = INT4_GROUP) -> None:
        super().__init__()
        q, scales_and_zeros = quantize_int4(weight, group)
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        self.group = group
        digest = hashlib.blake2b(digest_size=16)
        digest.update(q.to(torch.uint8).numpy().tobytes())
        digest.update(scales_and_zeros.view(torch.int16).numpy().tobytes())
        self.register_buffer("digest", torch.frombuffer(bytearray(digest.digest()),
                                                        dtype=torch.uint8))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().to(ACTIVATION_DTYPE), requires_grad=False)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return _int4_product(flat, self.packed, self.group, self.scales_and_zeros)


class FusedProjections(nn.Module):
    """Projections of one input, all Int4Linear (each a whole number of the kernel's
    packing blocks) or all Int8Linear, of one input size and without bias, as one matrix
    product: `forward(x)` returns each projection's output, as each would compute it (both
    kernels compute every output channel on its own, whatever the other channels). The
    projections' own weight tensors become views of the fused one, so both share its
    memory; int4's scales and zeros are copied (their layout does not slice into
    contiguous parts), about a tenth of the fused weight's bytes."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, parts: Sequence[Any]) -> None:
        super().__init__()
        kinds = {type(part) for part in parts}
        if len(parts) < 2 or len(kinds) != 1 or not kinds <= {Int4Linear, Int8Linear}:
            raise ValueError(f"cannot fuse {sorted(k.__name__ for k in kinds)}: "
                             "expected two or more Int4Linear or Int8Linear")
        if any(part.bias is not None for part in parts):
            raise ValueError("cannot fuse projections with a bias")
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("cannot fuse projections of different input sizes")
        self.int4 = kinds == {Int4Linear}
        if self.int4 and any(part.out_features % _INT4_PACK_BLOCK for part in parts):
            raise ValueError(f"cannot fuse int4 projections whose outputs are not whole "
                             f"blocks of {_INT4_PACK_BLOCK} (the kernel's packing)")
        self.sizes = [int(part.out_features) for part in parts]
        self.group = int(parts[0].group) if self.int4 else 0
        weight = "packed" if self.int4 else "weight_int8"
        fused = torch.cat([getattr(part, weight) for part in parts])
        scales = (torch.cat([part.scales_and_zeros for part in parts], dim=1) if self.int4
                  else torch.cat([part.scales for part in parts]))
        self.register_buffer("weight", fused, persistent=False)
        scales = scales.contiguous()
        self.register_buffer("scales", scales, persistent=False)
        start = 0
        for part, size in zip(parts, self.sizes, strict=True):
            # same values as before, now in the fused storage (a state dict is unchanged)
            setattr(part, weight, fused[start:start + size])
            if not self.int4:
                part.scales = scales[start:start + size]
            start += size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = _flat(x)
        y = (_int4_product(flat, self.weight, self.group, self.scales) if self.int4
             else _int8_product(flat, self.weight, self.scales))
        y = y.reshape(*x.shape[:-1], sum(self.sizes))
        return tuple(torch.split(y, self.sizes, dim=-1))


# (module holding the projections, their names, the name of their fused module)
_FUSIBLE = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_fused"),
            ("mlp", ("gate_proj", "up_proj"), "gate_up_fused"))


def fuse_projections(model: Any) -> int:
    """Give each Llama-style layer of `model` whose projections of one input are quantized
    alike a FusedProjections of them (`self_attn.qkv_fused`, `mlp.gate_up_fused`); how
    many were made. Layers of other shapes are left as they are."""
    made = 0
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        for owner_name, names, fused_name in _FUSIBLE:
            owner = getattr(layer, owner_name, None)
            parts = [getattr(owner, name, None) for name in names]
            try:
                fused = FusedProjections(parts)
            except (ValueError, AttributeError):
                continue
            setattr(owner, fused_name, fused)
            made += 1
    return made


def _quantized(linear: nn.Linear, fmt: str, is_head: bool) -> nn.Module:
    if fmt == "int4" and not is_head and int4_fits(linear.out_features, linear.in_features):
        return Int4Linear(linear.weight, linear.bias)
    return Int8Linear(linear.weight, linear.bias)


def quantize_model(model: Any, fmt: str) -> dict[str, int]:
    """Swap every nn.Linear of `model` (a float model on the CPU) for its quantized
    version in format `fmt`, in place, and move the rest to ACTIVATION_DTYPE. A tied
    output head gets its own quantized copy; the embedding stays float; projections of one
    input are fused as well (fuse_projections). Returns how many layers went to each kind,
    and how many fused projections were made."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}: expected one of {QUANT_FORMATS}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear)]
    counts = {"Int4Linear": 0, "Int8Linear": 0}
    for name, linear in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = _quantized(linear, fmt, linear is head)
        setattr(parent, child, new)
        counts[type(new).__name__] += 1
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # the head is its own (quantized) weight now
    model.to(ACTIVATION_DTYPE)  # embeddings, norms, biases; int buffers keep their dtype
    counts["FusedProjections"] = fuse_projections(model)
    return counts
