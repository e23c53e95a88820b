"""How far each weight format's next-token distribution sits from float32's, on MMLU.

    python -m bench.format_fidelity --json out/format_fidelity.json [--dtypes int4,bfloat16]
        [--subjects 57] [--questions 3] [--threads 2]

The embedded SmolLM2 ships as a GGUF of 4-bit (Q4_1) projections and an 8-bit (Q8_0)
output head; float32 is those weights expanded exactly, so it is the reference here. For
each 5-shot MMLU prompt (the first `--questions` of each of the first `--subjects`
subjects) every format computes the distribution of the next token (the answer's first
token); the bench reports how often its argmax is float32's and the KL divergence from
float32's distribution (mean, p90, max). A format that kept the shipped weights loses
nothing to float32 but its activations' rounding. Progress to stderr, JSON to --json and
stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.workloads import load_tokenized_mmlu
from peer.engine.api import AUTO_DTYPE, DTYPES
from peer.engine.model import DEFAULT_MODEL, load_model


def log_probs(dtype: str, prompts: list[list[int]], threads: int) -> torch.Tensor:
    """[prompts, vocab] log-probabilities of the token after each prompt, in `dtype`."""
    loaded = load_model(DEFAULT_MODEL, dtype=dtype, threads=threads)
    rows = []
    with torch.inference_mode():
        for ids in prompts:
            logits = loaded.model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            rows.append(torch.log_softmax(logits.float(), -1))
    return torch.stack(rows)


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and KL(reference || other) over rows of log-probabilities."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    return {
        "top1_agreement": float((other.argmax(-1) == reference.argmax(-1)).float().mean()),
        "kl_mean": float(kl.mean()),
        "kl_p90": float(kl.quantile(0.9)),
        "kl_max": float(kl.max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.format_fidelity",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dtypes", default="int4,bfloat16")
    parser.add_argument("--subjects", type=int, default=57)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    wrong = [d for d in dtypes if d not in DTYPES or d in (AUTO_DTYPE, "float32")]
    if not dtypes or wrong:  # before the reference's minutes, not after
        parser.error(f"--dtypes: formats to compare with float32, from "
                     f"{[d for d in DTYPES if d not in (AUTO_DTYPE, 'float32')]}; got {wrong}")
    if min(args.subjects, args.questions, args.threads) < 1:
        parser.error("--subjects, --questions and --threads must be >= 1")
    mmlu = load_tokenized_mmlu()
    prompts = [list(mmlu.prefixes[s]) + list(q)
               for s in range(min(args.subjects, len(mmlu.subjects)))
               for q in mmlu.questions[s][: args.questions]]
    out: dict[str, Any] = {"model": DEFAULT_MODEL, "prompts": len(prompts), "reference": "float32",
                           "threads": args.threads, "formats": {}}
    start = time.perf_counter()
    print(f"format_fidelity: {len(prompts)} prompts, float32 first", file=sys.stderr, flush=True)
    reference = log_probs("float32", prompts, args.threads)
    for dtype in dtypes:
        print(f"format_fidelity: {dtype}", file=sys.stderr, flush=True)
        out["formats"][dtype] = compare(reference, log_probs(dtype, prompts, args.threads))
    out["wall_s"] = time.perf_counter() - start
    text = json.dumps(out, indent=2)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
