"""transformers' own continuous batching on the bench's workload (`bench.engine --compare`).

The same closed loop as `bench.engine.engine_concurrent`, on transformers' manager
(`model.continuous_batching_context_manager`, paged KV cache, `ContinuousBatchingConfig`):
c clients each add their next prompt when their last one finished. Per request TTFT is
`timestamps[0] - created_time` (`add_request(record_timestamps=True)`: the manager stamps
each generated token and the request's creation). Prefix reuse is counted by wrapping
`PagedAttentionCache.search_prefix_match`, which returns the tokens a request found
already cached. The manager is created and warmed up before the clock starts, as the
engine's one-time costs are (`bench.engine.sweep`).

Blocking; run it in a worker thread. The model's attention implementation is switched to
"sdpa" for the run (transformers' manager accepts only sdpa, eager or flash) and put back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from bench.stats import percentile
from peer.engine.scheduler import DEFAULT_STEP_TOKENS
from protocols.blocks import DEFAULT_BLOCK_SIZE

# Our engine's step budget and block size, so both cores read prompts in chunks of the
# same size and share prefixes at the same granularity.
DEFAULT_MAX_BATCH_TOKENS = DEFAULT_STEP_TOKENS
DEFAULT_PAGE_SIZE = DEFAULT_BLOCK_SIZE
RESULT_POLL_S = 0.05


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: `5` into /proc/self/clear_refs), so that
    `peak_rss_bytes()` afterwards is the peak of what runs next; False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """VmHWM of this process (peak resident set since start or the last reset)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextmanager
def _count_prefix_hits() -> Iterator[list[int]]:
    """Counts the cached tokens transformers' cache finds for each request while open."""
    hits: list[int] = []
    original: Callable[..., int] = PagedAttentionCache.search_prefix_match

    def counting(self: PagedAttentionCache, request_id: str, prompt_ids: list[int]) -> int:
        n = original(self, request_id, prompt_ids)
        hits.append(n)
        return n

    PagedAttentionCache.search_prefix_match = counting  # type: ignore[method-assign]
    try:
        yield hits
    finally:
        PagedAttentionCache.search_prefix_match = original  # type: ignore[method-assign]


@contextmanager
def _sdpa(model: Any) -> Iterator[None]:
    before = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        model.config._attn_implementation = before


def cb_config(
    concurrency: int,
    block_sharing: bool,
    num_blocks: int,
    page_size: int = DEFAULT_PAGE_SIZE,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
) -> ContinuousBatchingConfig:
    """The manager's configuration for one level: at most `concurrency` requests a batch."""
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=concurrency,
        allow_block_sharing=block_sharing,
        auto_switch_to_flash=False,
        use_async_batching=False,
        use_cuda_graph=False,
    )


def transformers_cb_concurrent(
    model: Any,
    prompts: list[list[int]],
    concurrency: int,
    new_tokens: int,
    block_sharing: bool,
    page_size: int = DEFAULT_PAGE_SIZE,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    warmup: bool = True,
) -> dict[str, Any]:
    """Serve `prompts` with `concurrency` closed-loop clients on a fresh transformers
    continuous-batching manager; the same keys as `bench.engine.engine_concurrent`."""
    # Room for every prompt of the run at once, so neither variant is ever short of blocks
    # (a finished request's blocks stay cached for sharing until memory is needed).
    num_blocks = sum(-(-(len(p) + new_tokens) // page_size) for p in prompts) + 2 * concurrency
    gen = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    cfg = cb_config(concurrency, block_sharing, num_blocks, page_size, max_batch_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    ttfts: list[float] = []
    with (
        _sdpa(model),
        _count_prefix_hits() as hits,
        model.continuous_batching_context_manager(
            generation_config=gen,
            continuous_batching_config=cfg,
            warmup=warmup,
            block=True,
            timeout=30,
        ) as manager,
    ):
        todo = iter(range(len(prompts)))
        in_flight: dict[str, int] = {}

        def submit() -> bool:
            i = next(todo, None)
            if i is None:
                return False
            rid = manager.add_request(
                prompts[i], request_id=f"p{i}", max_new_tokens=new_tokens, record_timestamps=True
            )
            if rid is None:
                raise RuntimeError("transformers' manager refused a request")
            in_flight[rid] = i
            return True

        hits.clear()  # the warm-up's lookups are not the workload's
        start = time.perf_counter()
        for _ in range(concurrency):
            if not submit():
                break
        while in_flight:
            result = manager.get_result(timeout=RESULT_POLL_S)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
                continue
            if not result.is_finished() or result.request_id not in in_flight:
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers' manager failed a request: {result.error}")
            i = in_flight.pop(result.request_id)
            outputs[i] = list(result.generated_tokens)
            if result.timestamps:
                ttfts.append(result.timestamps[0] - result.created_time)
            submit()
        wall = time.perf_counter() - start
    return {
        "tokens_per_s": sum(len(o) for o in outputs) / wall,
        "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "wall_s": wall,
        "cached_tokens": sum(hits),
        "outputs": outputs,
    }


CB_CORES = [("transformers_cb", True), ("transformers_cb_no_sharing", False)]
COMPARED_FIELDS = ["tokens_per_s", "ttft_p50_s", "ttft_p99_s", "cached_tokens",
                   "peak_rss_bytes", "outputs_identical"]


def transformers_cb_keys(
    compared: dict[str, dict[str, dict[str, Any]]], page_size: int
) -> dict[str, Any]:
    """The `--compare transformers_cb` keys from per-core, per-level runs.

    `compare_by_core` {core: {FIELD_by_concurrency: {"c": value}}} for the cores "engine",
    "transformers_cb" and "transformers_cb_no_sharing", FIELD one of COMPARED_FIELDS:
    ttft_* for transformers is first token timestamp - request creation, cached_tokens the
    prompt tokens found cached, peak_rss_bytes VmHWM (reset before each level and core:
    model included), outputs_identical greedy against sequential `generate`;
    `ratio_engine_vs_CORE_by_concurrency` is our tokens/s over theirs."""
    out: dict[str, Any] = {
        "compare": "transformers_cb",
        "transformers_version": transformers.__version__,
        "transformers_cb_config": {
            "page_size": page_size, "max_batch_tokens": DEFAULT_MAX_BATCH_TOKENS,
            "max_requests_per_batch": "= concurrency", "attn_implementation": "sdpa (paged)",
            "ttft": "GenerationOutput.timestamps[0] - created_time (record_timestamps=True)",
        },
        "compare_by_core": {
            core: {f"{field}_by_concurrency": {c: r[field] for c, r in levels.items()}
                   for field in COMPARED_FIELDS}
            for core, levels in compared.items()
        },
    }
    ours = compared["engine"]
    for core, levels in compared.items():
        if core != "engine":
            out[f"ratio_engine_vs_{core}_by_concurrency"] = {
                c: ours[c]["tokens_per_s"] / r["tokens_per_s"] for c, r in levels.items()
            }
    return out
