"""The command line shared by the benches that time the compiled decode step in blocks
(bench.compile_options, bench.compute_thread): model, format, threads, context, blocks
of steps, and where the JSON goes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import emit_json
from peer.engine.model import DEFAULT_MODEL, DTYPES


def step_bench_main(prog: str, doc: str | None, run: Callable[[argparse.Namespace], Any],
                    argv: list[str] | None) -> int:
    """Parse `argv`, run the bench offline, write its JSON to --json and stdout."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="int4", choices=[d for d in DTYPES if d != "auto"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if min(args.threads, args.context, args.blocks, args.steps) < 1:
        parser.error("--threads, --context, --blocks and --steps must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    emit_json(run(args), args.json)
    return 0
