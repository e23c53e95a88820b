"""A tokenized MMLU set the testbed's tests draw workloads from: 72 short questions over
6 topics, tokenized by character, so no model's tokenizer is needed."""

from __future__ import annotations

from bench.workloads import TokenizedMMLU, tokenize_mmlu
from peer.demo_data import MmluQuestion


def mmlu_by_chars() -> TokenizedMMLU:
    questions = [
        MmluQuestion(f"topic {s}", f"What is {s} + {i}?",
                     (str(s + i), str(s + i + 1), "no", "all of the above"), "A")
        for s in range(6) for i in range(12)
    ]
    return tokenize_mmlu(lambda texts: [[ord(c) for c in t] for t in texts], "chars",
                         questions)
