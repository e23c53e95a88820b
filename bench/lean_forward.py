"""What the transformers module stack costs a decode step: the engine's packed forward
(`Runner.forward`) against a lean forward that calls the same layers' own weights and
kernels directly, on the same KV buffers.

    python -m bench.lean_forward --json out/lean_forward.json [--model smollm2-135m]
        [--dtypes float32,int8] [--threads 2] [--context 400] [--steps 24] [--batches 1,8]

The lean forward is a Llama decode step written out (peer/engine/compiled_decode.py
`written_out_step`, the step that --compile-decode compiles): embedding, rotary, per layer the
norms, the projections (the loaded `nn.Linear` or quantized layers, called directly), the
per-sequence K/V write and transformers' own SDPA function, the MLP, the final norm and the
head. It skips what a step through the model's `forward` adds: the module and kwargs
plumbing, mask building, output dataclasses, `logits_to_keep`. Its logits are compared
with the runner's from identical KV states (`max_abs_logit_diff`, `same_argmax`), then
both are timed step by step, alternating, on two copies of the same sequences
(`runner_step_ms`, `lean_step_ms`: medians; `*_cpu_ms`: the process's CPU time).
`module_stack_share` = 1 - lean / runner: what a lean forward could save at most.
Progress goes to stderr; the JSON to --json and stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.decode_profile import make_runner
from bench.report import emit_json
from peer.engine.compiled_decode import written_out_step
from peer.engine.model import DEFAULT_MODEL, DTYPES, LoadedModel, load_model
from peer.engine.runner import Runner, SeqKV

Seqs = list[tuple[SeqKV, int]]  # each sequence's KV and the token it feeds next


def log(msg: str) -> None:
    print(f"[bench.lean_forward] {msg}", file=sys.stderr, flush=True)


def lean_decode(model: Any, seqs: Seqs) -> torch.Tensor:
    """One decode step of every sequence (one token each) over the model's own layers,
    called directly (peer/engine/compiled_decode.py `written_out_step`, the step that
    `--compile-decode` compiles), each sequence's K and V written into its own buffer and
    attended with transformers' SDPA function; logits [len(seqs), vocab] (float32).
    Advances each SeqKV."""
    ids = torch.tensor([[tok for _, tok in seqs]], dtype=torch.long)
    positions = torch.tensor([[kv.length for kv, _ in seqs]], dtype=torch.long)

    def attend(index: int, attn: Any, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        outs = []
        for j, (kv, _) in enumerate(seqs):
            buf, at = kv.data[index], kv.length
            buf[0, :, at : at + 1] = k[0, :, j : j + 1]
            buf[1, :, at : at + 1] = v[0, :, j : j + 1]
            out, _ = sdpa_attention_forward(
                attn, q[:, :, j : j + 1], buf[0, :, : at + 1].unsqueeze(0),
                buf[1, :, : at + 1].unsqueeze(0), None, dropout=0.0, scaling=attn.scaling,
            )
            outs.append(out)
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    logits = written_out_step(model, ids, positions, attend)
    for kv, _ in seqs:
        kv.length += 1
    return logits


def prefilled(runner: Runner, loaded: LoadedModel, batch: int, context: int,
               room: int) -> Seqs:
    seqs = []
    for b in range(batch):
        kv = runner.new_kv([], context + room)
        prompt = [(100 + 7 * i + 13 * b) % loaded.vocab_size for i in range(context)]
        logits = runner.forward([(kv, prompt)], [1])
        seqs.append((kv, int(logits[0].argmax())))
    return seqs


def advance(seqs: Seqs, logits: torch.Tensor) -> None:
    nxt = logits.argmax(dim=-1).tolist()
    seqs[:] = [(kv, int(t)) for (kv, _), t in zip(seqs, nxt, strict=True)]


def compare(loaded: LoadedModel, batch: int, context: int, steps: int) -> dict[str, Any]:
    """Logits of both forwards from the same state, then both timed, alternating."""
    runner = make_runner(loaded)
    a = prefilled(runner, loaded, batch, context, 2 * steps + 8)
    b = [(SeqKV(kv.data.clone(), kv.length), tok) for kv, tok in a]
    steps_a: Callable[[], torch.Tensor] = lambda: runner.forward(  # noqa: E731
        [(kv, [tok]) for kv, tok in a], [1] * len(a))
    steps_b: Callable[[], torch.Tensor] = lambda: lean_decode(loaded.model, b)  # noqa: E731
    ref, lean = steps_a(), steps_b()
    diff = float((ref - lean).abs().max())
    same = bool(torch.equal(ref.argmax(dim=-1), lean.argmax(dim=-1)))
    advance(a, ref)
    advance(b, lean)
    wall: dict[str, list[float]] = {"runner": [], "lean": []}
    cpu: dict[str, list[float]] = {"runner": [], "lean": []}
    for i in range(steps):
        order = (("runner", steps_a, a), ("lean", steps_b, b))
        for name, step, seqs in order if i % 2 == 0 else order[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            logits = step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
            advance(seqs, logits)
    row: dict[str, Any] = {"batch": batch, "max_abs_logit_diff": diff, "same_argmax": same}
    for name in ("runner", "lean"):
        row[f"{name}_step_ms"] = statistics.median(wall[name]) * 1000
        row[f"{name}_step_cpu_ms"] = statistics.median(cpu[name]) * 1000
    row["module_stack_share"] = 1 - row["lean_step_ms"] / row["runner_step_ms"]
    row["module_stack_share_cpu"] = 1 - row["lean_step_cpu_ms"] / row["runner_step_cpu_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lean_forward", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes takes some of {DTYPES}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        parser.error("--batches takes comma-separated integers")
    if min([args.threads, args.context, args.steps, *batches]) < 1:
        parser.error("--threads, --context, --steps and every batch must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out: dict[str, Any] = {
        "model": args.model, "threads": args.threads, "context": args.context,
        "steps": args.steps, "load_average_1m_start": os.getloadavg()[0], "rows": [],
    }
    for dtype in dtypes:
        # SDPA, which the written-out step calls too (int8 and int4 default to the fixed-order
        # attention since this bench was written)
        loaded = load_model(args.model, dtype=dtype, device="cpu", threads=args.threads,
                            attention="sdpa")
        if loaded.model.config.model_type != "llama":
            parser.error(f"the lean forward is written for Llama models, not "
                         f"{loaded.model.config.model_type}")
        with torch.inference_mode():
            for batch in batches:
                row = {"dtype": dtype, **compare(loaded, batch, args.context, args.steps)}
                out["rows"].append(row)
                log(f"{dtype} batch {batch}: runner {row['runner_step_ms']:.1f} ms, lean "
                    f"{row['lean_step_ms']:.1f} ms ({row['module_stack_share']:+.1%}), "
                    f"logit diff {row['max_abs_logit_diff']:.2g} "
                    f"(load {os.getloadavg()[0]:.1f})")
        del loaded
    out.update(load_average_1m_end=os.getloadavg()[0], cpus=os.cpu_count(),
               torch=torch.__version__,
               cpu_capability=torch.backends.cpu.get_cpu_capability())
    emit_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
