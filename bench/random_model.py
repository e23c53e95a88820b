"""`python -m bench.random_model PATH --hidden 512 --layers 4`: a random-weight Llama with
the SmolLM2 tokenizer, saved as a checkpoint folder that `serve --model PATH` loads.

tiny-random (hidden 64, 2 layers) makes a request mostly the peer's own overhead: a
512-token prefill costs about what a forward costs its entry. The testbed's what-ifs use a
larger one, built here, where the prefill is most of a request and a cached prefix is
worth a forward. Same shape rules as tiny-random (untied, wide initialisation: a random
tied model repeats its last token), a fixed seed, so every peer that builds it with the
same arguments holds the same weights (the model id's fingerprint checks it).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

from peer.engine.embedded import TINY_CONFIG, load_smollm2_tokenizer, random_llama


def build(path: Path, hidden: int, layers: int, seed: int) -> Any:
    """Write the model and its tokenizer to `path`; the model is returned for timing."""
    tokenizer = load_smollm2_tokenizer()
    shape = {**TINY_CONFIG, "hidden_size": hidden, "intermediate_size": 3 * hidden,
             "num_hidden_layers": layers}
    model = random_llama(tokenizer, shape, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


SPEC = re.compile(r"random-(\d+)x(\d+)")  # a model built here by name: hidden x layers
DEFAULT_SEED = 7


def from_spec(name: str, folder: Path) -> Path | None:
    """`random-<hidden>x<layers>` (e.g. random-256x2) built under `folder` (reused when
    there already), with DEFAULT_SEED: its path; None when `name` is not such a name."""
    match = SPEC.fullmatch(name)
    if match is None:
        return None
    hidden, layers = int(match[1]), int(match[2])
    heads = int(TINY_CONFIG["num_attention_heads"])
    if hidden <= 0 or layers <= 0 or hidden % heads:
        raise ValueError(f"{name}: hidden must be a positive multiple of {heads}, layers > 0")
    path = folder / name
    if not (path / "config.json").exists():
        build(path, hidden, layers, DEFAULT_SEED)
    return path


def prefill_cpu_ms(model: Any, tokens: int = 512, repeats: int = 3) -> float:
    """One thread's CPU per cold prefill of `tokens` (last position's logits only, as the
    engine computes them), float32."""
    import torch

    torch.set_num_threads(1)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.no_grad():
        model(ids, logits_to_keep=1)
        start = time.process_time()
        for _ in range(repeats):
            model(ids, logits_to_keep=1)
    return (time.process_time() - start) / repeats * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.random_model", description=__doc__)
    p.add_argument("path", type=Path, help="the checkpoint folder to write")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = p.parse_args(argv)
    heads = int(TINY_CONFIG["num_attention_heads"])
    if args.hidden <= 0 or args.layers <= 0 or args.hidden % heads:
        p.error(f"--hidden must be a positive multiple of {heads}, --layers positive")
    model = build(args.path, args.hidden, args.layers, args.seed)
    print(f"{args.path}: hidden {args.hidden}, {args.layers} layers; a cold 512-token "
          f"prefill costs {prefill_cpu_ms(model):.0f} ms of one thread (float32)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
