"""One sequence's decode step, compiled ahead (torch.compile, inductor's CPU backend).

A small model's decode step on a CPU is mostly the cost of dispatching its ~600 small ops
one by one from Python (docs/engine.md, "Where a decode step's time goes"). Compiled, the
pointwise ops between the projections fuse into C++ loops, the wrapper that calls them is
C++ (`cpp_wrapper`) and the weights are frozen in as constants. A quantized layer's
projections of one input (q, k, v; gate, up) are one product each
(quant.FusedProjections), and each matrix product (int4, int8 or bfloat16) is inductor's
own C++ kernel for its shape, built for the frozen weight, where that times faster than
torch's kernel at compile time (max-autotune). It sums in another order, so the compiled
step's logits are the eager step's to a few bfloat16 steps, not bit for bit. Only
a lone decoding sequence takes this path (Runner.forward): the batch of one that a peer
with a single client runs. The step reads the sequence's own KV buffer up to the next
multiple of ATTEND_BLOCK positions, under a mask of the positions filled, so every length
and capacity reuses the one compiled graph (the window is a dynamic dimension). The
buffer is allocated uninitialised (Runner.new_kv), so the unfilled positions of the window
are zeroed first: masked scores still multiply the values, and garbage there (a NaN)
would reach the output.

Llama-architecture models on the CPU only. Compiling SmolLM2 takes one to three minutes
on two cores, at every start (inductor's cache on disk saved little of it here).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .runner import SeqKV

# Inductor: weights as constants, the wrapper in C++ (no Python between the kernels),
# each matrix product the faster of torch's kernel and inductor's C++ one for its shape.
INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "freezing": True, "cpp_wrapper": True,
    "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
    "max_autotune_report_choices_stats": False,
}
ATTEND_BLOCK = 64  # the window read grows by this many positions at a time
# The throw-away buffers that compile the step, (capacity, window): two different ones,
# each window shorter than its buffer, so that the graph is built with both symbolic.
_COMPILE_SHAPES = ((96, 48), (160, 80))


# Attention of one layer: (layer index, its attention module, q [1, heads, n, head_dim],
# k and v [1, kv_heads, n, head_dim]) -> [1, n, heads, head_dim], K and V stored as it likes
Attend = Callable[[int, Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _projections(owner: Any, fused: str, names: tuple[str, ...], x: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """`owner`'s projections `names` of `x`: one call of its fused module where quantization
    made one (quant.fuse_projections), else one call each."""
    module = getattr(owner, fused, None)
    if module is not None:
        return tuple(module(x))
    return tuple(getattr(owner, name)(x) for name in names)


def written_out_step(model: Any, ids: torch.Tensor, positions: torch.Tensor,
                     attend: Attend,
                     rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step of a Llama model over its own modules, `ids` and `positions` [1, n]
    (one new token for each of n sequences): what transformers' LlamaForCausalLM computes,
    without its module plumbing (kwargs, masks, output dataclasses). Attention, the one
    part that depends on where K and V live, is `attend`'s. `rotary` is the model's
    (cos, sin) at `positions` where the caller computed them (None: computed here).
    Logits [n, vocab] (float32)."""
    inner = model.model
    n = ids.shape[1]
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, position_ids=positions) if rotary is None else rotary
    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (1, n, -1, attn.head_dim)
        q, k, v = (p.reshape(shape).transpose(1, 2) for p in _projections(
            attn, "qkv_fused", ("q_proj", "k_proj", "v_proj"), x))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        h = h + attn.o_proj(attend(index, attn, q, k, v).reshape(1, n, -1))
        mlp = layer.mlp
        gate, up = _projections(mlp, "gate_up_fused", ("gate_proj", "up_proj"),
                                layer.post_attention_layernorm(h))
        h = h + mlp.down_proj(mlp.act_fn(gate) * up)
    logits: torch.Tensor = model.lm_head(inner.norm(h))[0].float()
    return logits


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token's attention, written out as products and sums that inductor fuses into
    its own vectorised loops, in float32: q [1, heads, 1, head_dim], keys and values
    [kv_heads, window, head_dim] (query head h reads K/V head h // (heads / kv_heads), as
    grouped-query attention does), `mask` True where a position is read. Returns
    [1, 1, heads, head_dim] in q's dtype.

    Not scaled_dot_product_attention: compiled, it becomes matrix-vector products that
    torch hands to MKL, whose bfloat16 gemv takes its generic code path on AMD CPUs, half
    of the compiled int4 step there (docs/engine.md, "The compiled step's attention")."""
    kv_heads, window, head_dim = keys.shape
    heads = q.shape[1]
    grouped = q.reshape(kv_heads, heads // kv_heads, 1, head_dim).float()
    scores = (grouped * keys.unsqueeze(1).float()).sum(-1) * scale  # [kv_heads, group, window]
    scores = scores.masked_fill(~mask.reshape(1, 1, window), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs.unsqueeze(-1) * values.unsqueeze(1).float()).sum(-2)  # [kv_heads, group, dim]
    return out.to(q.dtype).reshape(1, 1, heads, head_dim)


class CompileDecodeError(RuntimeError):
    """The model cannot take a compiled decode step; the message says why."""


def supported(model: Any) -> str | None:
    """None where `model` can take the compiled step, else why not."""
    config = model.config
    if config.model_type != "llama":
        return f"the compiled decode step is written for Llama models, not {config.model_type}"
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"the compiled decode step runs on the CPU, the model is on {device}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "the compiled decode step does not split projections (pretraining_tp > 1)"
    return None


@contextlib.contextmanager
def _compile_settings() -> Iterator[None]:
    """What must hold while Dynamo traces, beyond the options given to the compile: it
    reads `freezing` from the global config (the option alone leaves every weight a graph
    input, so nothing is frozen and no C++ product applies), and the autotuner's table of
    timings per product stays off stderr."""
    from torch._inductor import select_algorithm

    printed = select_algorithm.PRINT_AUTOTUNE
    select_algorithm.PRINT_AUTOTUNE = False
    try:
        with torch._inductor.config.patch(freezing=True):
            yield
    finally:
        select_algorithm.PRINT_AUTOTUNE = printed


class CompiledDecode:
    """`step(kv, token)`: feed one token after `kv`'s cached ones through the compiled
    graph; logits [1, vocab] (float32). Advances kv.length as Runner.forward does."""

    def __init__(self, model: Any) -> None:
        why = supported(model)
        if why is not None:
            raise CompileDecodeError(why)
        self._model = model
        self._layers = int(model.config.num_hidden_layers)
        self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False,
                                       options=INDUCTOR_OPTIONS)
        first = next(model.parameters())
        # rotary_emb reads only its input's dtype and device: an empty tensor of the
        # activations' dtype (the embedding's) stands in for the hidden state
        self._rotary_like = torch.empty(0, dtype=model.model.embed_tokens.weight.dtype,
                                         device=first.device)
        self._ready = False
        self.steps = 0  # compiled steps run, the compile's own included

    def _step(self, token: torch.Tensor, position: torch.Tensor,
              kv: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The step that is compiled: `written_out_step` with each layer's K and V written
        in place at `position` and attended over the window under a mask. The rotary
        `cos` and `sin` come in computed: inside the graph inductor fused them into every
        layer's attention loop and took their sines and cosines again at every position of
        the window (a tenth of the int4 step on an AMD EPYC)."""
        window = kv[0].shape[1]
        mask = (torch.arange(window) <= position).view(1, 1, 1, window)

        def attend(index: int, attn: Any, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            keys, values = kv[2 * index], kv[2 * index + 1]
            keys.index_copy_(1, position, k[0])
            values.index_copy_(1, position, v[0])
            return grouped_attention(q, keys, values, mask, attn.scaling)

        return written_out_step(self._model, token, position.view(1, 1), attend, (cos, sin))

    def _views(self, kv: SeqKV, window: int) -> list[torch.Tensor]:
        """Each layer's K and V, [kv_heads, window, head_dim], the unfilled part zeroed."""
        clean = max(kv.length, kv.zeroed_to)
        if window > clean:
            kv.data[:, :, :, clean:window].zero_()
            kv.zeroed_to = window
        if kv.step_views is None or kv.step_views[0] != window:  # once a window: 60 views
            views = [kv.data[layer, part, :, :window]  # and their marks cost ~0.25 ms
                     for layer in range(self._layers) for part in (0, 1)]
            for view in views:  # any window, any capacity: one graph
                torch._dynamo.mark_dynamic(view, 1)
            kv.step_views = (window, views)
        return kv.step_views[1]

    def _run(self, kv: SeqKV, token: int, window: int | None = None) -> torch.Tensor:
        if kv.length >= kv.capacity:
            raise ValueError(f"cannot feed a token at {kv.length}/{kv.capacity} tokens")
        if window is None:
            blocks = kv.length // ATTEND_BLOCK + 1
            window = min(kv.capacity - 1, blocks * ATTEND_BLOCK)
        device = kv.data.device
        with torch.inference_mode():
            position = torch.tensor([kv.length], dtype=torch.long, device=device)
            cos, sin = self._model.model.rotary_emb(self._rotary_like, position.view(1, 1))
            logits = self._compiled(
                torch.tensor([[token]], dtype=torch.long, device=device),
                position,
                self._views(kv, window),
                cos,
                sin,
            )
        kv.length += 1
        self.steps += 1
        return logits

    def compile(self) -> float:
        """Build the graph now (blocking: one to three minutes for SmolLM2 on two cores) on
        throw-away buffers laid out as Runner.new_kv lays them; seconds taken."""
        config = self._model.config
        first = next(self._model.parameters())
        heads = config.num_key_value_heads
        head_dim = self._model.model.layers[0].self_attn.head_dim
        start = time.perf_counter()
        with _compile_settings():
            for capacity, window in _COMPILE_SHAPES:
                data = torch.zeros((self._layers, 2, heads, capacity, head_dim),
                                   dtype=first.dtype, device=first.device)
                self._run(SeqKV(data, 0), 1, window)
        self._ready = True
        return time.perf_counter() - start

    def accepts(self, kv: SeqKV) -> bool:
        """Whether `kv` has room for its next token short of its last position: the graph
        is built for a window that is part of its buffer (Runner.new_kv keeps one spare)."""
        return kv.length + 1 < kv.capacity

    def __call__(self, kv: SeqKV, token: int) -> torch.Tensor:
        """One compiled step; an input the graph was not built for raises (a recompile would
        stall the engine for a minute), and the caller runs the eager step instead."""
        if not self._ready:
            raise CompileDecodeError("the decode step is not compiled yet")
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._run(kv, token)


def compile_decode(model: Any) -> CompiledDecode:
    """A CompiledDecode for `model`, compiled now, with a line on stderr before and after."""
    print("prefixswarm: compiling the decode step (minutes on two cores)...",
          file=sys.stderr, flush=True)
    step = CompiledDecode(model)
    seconds = step.compile()
    print(f"prefixswarm: compiling the decode step: done in {seconds:.1f} s",
          file=sys.stderr, flush=True)
    return step
