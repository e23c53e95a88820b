"""The model runner: one forward over a packed batch of sequences (torch, worker thread).

Every step packs the new tokens of all scheduled sequences into one row,
``[1, total_tokens]``, with per-token position ids: decodes (one token each) and prefill
chunks alike. The projections and MLPs then read the weights once for the whole batch,
which is what makes batching pay on a CPU (and a GPU). Attention is the one part that is
per sequence: a registered transformers attention function writes each sequence's new K
and V into that sequence's own buffer (`SeqKV`) and attends over its cached + new tokens
with transformers' own SDPA function, so each sequence computes exactly what an unbatched
forward computes (same kernel, same mask rule, same GQA handling).

Outside a packed step (`model.generate`, say) the registered function is plain SDPA with
SDPA's masks, so the loaded model still serves transformers' own API unchanged.

A model loaded with the fixed-order attention (fixed_attention.py; load_model's
``attention``) names FIXED_ATTENTION_NAME instead: packed steps and plain forwards alike
then compute every row with that kernel, so `generate` stays the engine's reference.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .fixed_attention import fixed_order_attention, fixed_order_decode
from .kv import KVLayout

ATTENTION_NAME = "prefixswarm_packed"
FIXED_ATTENTION_NAME = "prefixswarm_fixed"
FIXED_ATTENTION_LABEL = "prefixswarm::fixed_order_attention"  # its calls, in a profile
# whether a torch profiler records: what record_function checks itself (not exported)
_profiling: Callable[[], bool] = torch.autograd._profiler_enabled  # type: ignore[attr-defined]
_BATCH_KWARG = "prefixswarm_batch"


class SeqKV:
    """One sequence's K and V for every layer: [layers, 2, kv_heads, capacity, head_dim].

    Allocated once at the sequence's final size (prompt + max_new_tokens): untouched pages
    of a large CPU allocation are not committed, so the unused tail costs address space only.
    """

    __slots__ = ("data", "length", "step_views", "zeroed_to")

    def __init__(self, data: torch.Tensor, length: int) -> None:
        self.data = data
        self.length = length
        self.zeroed_to = 0  # positions below max(length, this) hold K/V or zeros, never garbage
        # compiled_decode's views of this buffer for its current window, made once a window
        self.step_views: tuple[int, list[torch.Tensor]] | None = None

    @property
    def capacity(self) -> int:
        return int(self.data.shape[3])

    def blocks(self, first_block: int, end_block: int, block_size: int) -> list[torch.Tensor]:
        """Private contiguous copies of blocks [first_block, end_block)."""
        if end_block * block_size > self.length:
            raise ValueError(
                f"sequence holds {self.length} tokens, blocks need {end_block * block_size}"
            )
        return [
            self.data[:, :, :, b * block_size : (b + 1) * block_size].clone(
                memory_format=torch.contiguous_format
            )
            for b in range(first_block, end_block)
        ]


@dataclass
class _Span:
    start: int  # in the packed row
    end: int
    kv: SeqKV
    pos: int  # tokens already in kv before this step
    mask: torch.Tensor | None  # [1, 1, n, pos + n] bool for a chunk after cached tokens (SDPA)


@dataclass
class _Batch:
    spans: list[_Span]


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered under both names; the model's config says which it runs."""
    batch: _Batch | None = kwargs.pop(_BATCH_KWARG, None)
    if module.config._attn_implementation == FIXED_ATTENTION_NAME:
        # one labelled span per call while a profiler records (bench.decode_profile)
        with torch.profiler.record_function(FIXED_ATTENTION_LABEL) if _profiling() \
                else contextlib.nullcontext():
            return _fixed_attention(module, query, key, value, attention_mask, batch,
                                    kwargs.get("scaling")), None
    if batch is None:  # not a packed step: behave exactly as "sdpa"
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _per_span(module, query, key, value, batch, lambda sp, q, k, v: sdpa_attention_forward(
        module, q, k, v, sp.mask, **kwargs)[0])


def _fixed_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, batch: _Batch | None, scaling: float | None,
) -> torch.Tensor:
    """fixed_attention.py's kernel: per chunk, and all of a step's decodes in one call."""
    if scaling is None:
        scaling = module.scaling
    if batch is None:  # a plain forward: causal, or the boolean mask transformers built
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError("the fixed-order attention takes boolean masks only")
        return fixed_order_attention(query, key, value, scaling, allowed=attention_mask).to(
            query.dtype)
    layer = module.layer_idx
    outs: list[torch.Tensor | None] = []
    decodes: list[int] = []
    for i, sp in enumerate(batch.spans):
        _write_span(sp, layer, key, value)
        if sp.end - sp.start == 1:  # decodes: one call for all of them, after the loop
            decodes.append(i)
            outs.append(None)
            continue
        k, v = _span_kv(sp, layer)
        outs.append(fixed_order_attention(query[:, :, sp.start : sp.end], k, v, scaling,
                                          offset=sp.pos).to(query.dtype))
    if decodes:
        if len(decodes) == 1:  # a view: [1, heads, 1, head_dim]
            start = batch.spans[decodes[0]].start
            rows = query[:, :, start : start + 1]
        else:
            rows = torch.stack([query[0, :, batch.spans[i].start] for i in decodes])[:, :, None]
        kvs = [_span_kv(batch.spans[i], layer) for i in decodes]
        together = fixed_order_decode(rows, [k for k, _ in kvs], [v for _, v in kvs], scaling,
                                      out_dtype=query.dtype)
        for j, i in enumerate(decodes):
            outs[i] = together[j : j + 1]
    done = [o for o in outs if o is not None]
    return torch.cat(done, dim=1) if len(done) > 1 else done[0]


def _per_span(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: _Batch,
    attend: Callable[[_Span, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, None]:
    """Each span's new K/V written into its own buffer, then ``attend`` over its cached +
    new K/V ([1, n, heads, head_dim] per span), concatenated in the packed row's order."""
    layer = module.layer_idx
    outs = []
    for sp in batch.spans:
        _write_span(sp, layer, key, value)
        k, v = _span_kv(sp, layer)
        outs.append(attend(sp, query[:, :, sp.start : sp.end], k, v))  # [1, n, heads, head_dim]
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], None


def _write_span(sp: _Span, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """The span's new K/V into its sequence's buffer."""
    buf = sp.kv.data[layer]
    buf[0, :, sp.pos : sp.pos + sp.end - sp.start] = key[0, :, sp.start : sp.end]
    buf[1, :, sp.pos : sp.pos + sp.end - sp.start] = value[0, :, sp.start : sp.end]


def _span_kv(sp: _Span, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The span's cached + new K and V, [1, kv_heads, tokens, head_dim] each."""
    buf = sp.kv.data[layer]
    end = sp.pos + sp.end - sp.start
    return buf[0, :, :end].unsqueeze(0), buf[1, :, :end].unsqueeze(0)


for _name in (ATTENTION_NAME, FIXED_ATTENTION_NAME):
    AttentionInterface.register(_name, _attention)
    AttentionMaskInterface.register(_name, sdpa_mask)


class DecodeStep(Protocol):
    """One sequence, one new token (compiled_decode.CompiledDecode)."""

    def accepts(self, kv: SeqKV) -> bool:
        """Whether this step can feed `kv` its next token."""

    def __call__(self, kv: SeqKV, token: int) -> torch.Tensor:
        """Logits [1, vocab] (float32); kv advanced by one token."""


class Runner:
    """Runs packed forwards of one model; owns no request state. A lone sequence's decode
    goes through `decode_step` where one is given (a compiled step); if that step refuses
    an input, this step and every later one runs eagerly. Every forward runs with `threads`
    torch CPU threads where given: OpenMP's count is per thread, so a worker thread that
    ran torch before the model was loaded keeps its old count otherwise (and a compiled
    step, built for one count, would refuse it)."""

    def __init__(self, model: Any, layout: KVLayout, decode_step: DecodeStep | None = None,
                 threads: int | None = None) -> None:
        self.model = model
        self.layout = layout
        self.decode_step = decode_step
        self.threads = threads
        first = next(model.parameters())
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        self._sdpa = model.config._attn_implementation != FIXED_ATTENTION_NAME
        if self._sdpa:
            model.config._attn_implementation = ATTENTION_NAME  # SDPA outside steps
        # A 4-D mask is taken as given: the packed step needs no mask built for the row.
        self._no_mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=self.device)

    def new_kv(self, blocks: Sequence[torch.Tensor], capacity: int) -> SeqKV:
        """A sequence buffer of `capacity` tokens starting with the given cached blocks."""
        lay = self.layout
        data = torch.empty(  # one spare position: compiled_decode's window is never whole
            (lay.num_layers, 2, lay.num_kv_heads, capacity + 1, lay.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        pos = 0
        for block in blocks:
            size = int(block.shape[3])
            data[:, :, :, pos : pos + size] = block
            pos += size
        return SeqKV(data, pos)

    def forward(
        self, items: Sequence[tuple[SeqKV, Sequence[int]]], want: Sequence[int]
    ) -> torch.Tensor:
        """Feed each item's tokens after its cached ones; logits [k, vocab] (float32) of the
        last `want` tokens of each item (True: the last one), in order. Advances each
        SeqKV's length."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.decode_step is not None and len(items) == 1 and len(items[0][1]) == 1 \
                and want[0] == 1 and self.decode_step.accepts(items[0][0]):
            kv, tokens = items[0]
            try:
                return self.decode_step(kv, int(tokens[0]))
            except Exception as exc:
                print(f"prefixswarm: the compiled decode step failed ({exc.__class__.__name__}:"
                      f" {str(exc).splitlines()[0] if str(exc) else ''}); decoding eagerly "
                      "from now on", file=sys.stderr, flush=True)
                self.decode_step = None
        ids: list[int] = []
        positions: list[int] = []
        spans: list[_Span] = []
        keep: list[int] = []
        for (kv, tokens), wanted in zip(items, want, strict=True):
            n = len(tokens)
            if n == 0 or kv.length + n > kv.capacity or not 0 <= wanted <= n:
                raise ValueError(f"cannot feed {n} tokens at {kv.length}/{kv.capacity} tokens"
                                 f" with the last {wanted} rows' logits")
            start = len(ids)
            ids.extend(tokens)
            positions.extend(range(kv.length, kv.length + n))
            mask = None
            if n > 1 and kv.length > 0 and self._sdpa:  # SDPA's mask for a chunk after
                # cached tokens: causal, offset by pos (the fixed-order kernel takes pos)
                q = torch.arange(kv.length, kv.length + n, device=self.device)[:, None]
                k = torch.arange(kv.length + n, device=self.device)[None, :]
                mask = (k <= q)[None, None]
            spans.append(_Span(start, start + n, kv, kv.length, mask))
            keep.extend(range(start + n - int(wanted), start + n))
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
                attention_mask=self._no_mask,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),
                **{_BATCH_KWARG: _Batch(spans)},
            )
        for sp in spans:
            sp.kv.length = sp.pos + (sp.end - sp.start)
        logits: torch.Tensor = out.logits[0].float()
        return logits
