"""Generation with prefix reuse and continuous batching over the radix cache.

Requests share one batch: every step is one forward over the next token of every decoding
request plus prefill chunks of new prompts, within a token budget (scheduler.py), computed
by runner.py in a worker thread. There is no background task: each request's own task
either runs the next step for everybody (when no step is running) or waits for the
running one, then hands out its own new tokens. Admission happens between steps, and a
cancelled request leaves the batch at the next step. Work outside the batch (verify.py's
chunks, a warm-up) takes the model lock in turn with the steps. The radix tree is touched
only on the event loop. Matched blocks stay locked for the whole request. A request still
computes only its uncached suffix: its sequence buffer starts as a copy of the matched
blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import torch
import trio

from protocols.blocks import DEFAULT_BLOCK_SIZE, BlockHasher

from .api import (
    Completion,
    EngineError,
    EngineLoad,
    InvalidRequest,
    SamplingParams,
    TokenEvent,
    Usage,
    Verdict,
)
from .kv import DEFAULT_CACHE_BYTES, KVLayout
from .model import LoadedModel, load_model
from .radix import RadixCache
from .requests import (
    RequestState,
    StopTracker,
    encode_prompt,
    sample_token,
    validate_prompt,
)
from .runner import Runner, SeqKV
from .scheduler import (
    DEFAULT_MAX_RUNNING,
    DEFAULT_STEP_TOKENS,
    StepPlan,
    admit_count,
    plan_step,
    reusable_blocks,
    reusable_tokens,
)
from .speeds import StepSpeeds, observe_step, warmup_max_prompt_tokens
from .verify import verify_output
from .warmup import Progress, measure_speeds

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineLoad",
    "InvalidRequest",
    "SamplingParams",
    "TokenEvent",
    "Usage",
    "Verdict",
    "load_engine",
]

# Speeds that no request refreshed for this long are measured again while the engine is
# idle. A peer that once measured itself slow (start-up on a busy machine) is sent no work
# by anyone, itself included, so no request would ever correct it (seen: one of four
# tiny-random peers served 0 of 158 requests).
SPEED_REFRESH_S = 30.0
SPEED_REFRESH_MAX_S = 600.0  # an idle peer's re-measurements back off to this (doubling)


class Engine:
    """One model with a prefix KV cache, serving concurrent requests in one batch."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_generated: bool = False,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        max_running: int = DEFAULT_MAX_RUNNING,
    ) -> None:
        if step_tokens < 1 or max_running < 1:
            raise ValueError("step_tokens and max_running must be >= 1")
        self._loaded = loaded
        self._model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.model_id
        self.vocab_size = loaded.vocab_size
        self.max_context = loaded.max_context
        self.block_size = block_size
        self.hasher = BlockHasher(loaded.model_id, block_size)
        itemsize = next(self._model.parameters()).element_size()
        self.layout = KVLayout(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, block_size, itemsize
        )
        self._runner = Runner(self._model, self.layout)
        self.cache_bytes = cache_bytes
        self.cache: RadixCache[torch.Tensor] = RadixCache(
            block_size, self.layout.capacity_blocks(cache_bytes), self.hasher
        )
        # Generated tokens' KV comes from one-token decode steps, which may differ from a
        # prefill in the last bits; off by default so cached == uncached stays exact.
        self.cache_generated = cache_generated
        self.step_tokens = step_tokens
        self.max_running = max_running
        self._eos = frozenset(loaded.eos_token_ids)
        self._waiting: deque[RequestState] = deque()
        # Called with each request's wait before its first step (metrics: queue wait).
        self.queue_wait_observers: list[Callable[[float], None]] = []
        self._batch: dict[int, RequestState] = {}  # admitted, unfinished; insertion order = age
        self._next_rid = 0
        self._stepping = False  # a step is running or waits for the model
        # Held by a step and by work outside the batch (a warm-up, a verification chunk):
        # one at a time, and in turn, since trio's Lock hands over in FIFO order.
        self.model_lock = trio.Lock()
        self._step_done = trio.Event()
        self._queued_prompt_tokens = 0
        self._running = 0  # requests between submission and release
        self._prefill_tps = 0.0
        self._decode_tps = 0.0
        self._batch_decode_tps = 0.0
        self._speed_samples = 0  # prefill speed samples taken so far
        self._stats = {
            "requests": 0,
            "completed_requests": 0,
            "cancelled_requests": 0,
            "failed_requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "computed_prompt_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
            "step_tokens": 0,
            "max_batch": 0,
            "verifications": 0,
            "verifications_failed": 0,
            "verified_tokens": 0,
        }

    @classmethod
    def from_model(
        cls,
        loaded: LoadedModel,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_generated: bool = False,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        max_running: int = DEFAULT_MAX_RUNNING,
    ) -> Engine:
        """An engine with a fresh, empty cache around an already loaded model."""
        return cls(loaded, cache_bytes, block_size, cache_generated, step_tokens, max_running)

    @classmethod
    async def open(
        cls,
        name: str,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        **load: Any,
    ) -> Engine:
        """Load `name` in a worker thread (seconds; minutes on first use) and warm it up.
        `load` goes to load_model (dtype, device, threads)."""
        return await trio.to_thread.run_sync(
            lambda: load_engine(name, cache_bytes, block_size, **load)
        )

    # -- tokens and text -----------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a text prompt, or of chat messages through the chat template."""
        return encode_prompt(self.tokenizer, prompt, self.max_context)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or InvalidRequest naming the limit."""
        return validate_prompt(token_ids, params, self.vocab_size, self.max_context)

    # -- queries for the router ----------------------------------------------------------

    def local_match_tokens(self, token_ids: Sequence[int], cache_salt: bytes | None = None) -> int:
        """Tokens of the longest cached prefix (block-aligned); no side effect."""
        return self.cache.peek(token_ids, salt=cache_salt)

    def _reusable_tokens(self, tokens: Sequence[int], salt: bytes | None) -> int:
        return reusable_tokens(self.cache.peek(tokens, salt=salt), len(tokens), self.block_size)

    def generating(self) -> Engine:
        """This engine generates (api.py's EngineView.generating)."""
        return self

    def load(self) -> EngineLoad:
        """Queued (uncached) prompt tokens, running and waiting requests, measured speeds."""
        return EngineLoad(
            self._queued_prompt_tokens,
            self._running,
            self._prefill_tps,
            self._decode_tps,
            waiting_requests=len(self._waiting),
            batch_decode_tokens_per_s=self._batch_decode_tps,
            batch_slots=self.max_running,
            step_tokens=self.step_tokens,
        )

    def statistics(self) -> dict[str, int | float]:
        """Request and token counters, speeds, and the cache's statistics (prefixed cache_)."""
        out: dict[str, int | float] = dict(self._stats)
        out["running_requests"] = self._running
        out["waiting_requests"] = len(self._waiting)
        out["batch_size"] = len(self._batch)
        out["queued_prompt_tokens"] = self._queued_prompt_tokens
        out["prefill_tokens_per_s"] = self._prefill_tps
        out["decode_tokens_per_s"] = self._decode_tps
        out["batch_decode_tokens_per_s"] = self._batch_decode_tps
        out["cache_bytes"] = self.cache_bytes
        out["cache_block_bytes"] = self.layout.block_bytes
        for key, value in self.cache.statistics().items():
            out[f"cache_{key}"] = value
        return out

    def warmup(self, progress: Progress | None = None) -> None:
        """Run short prefills and a few decode steps to seed the speed estimates (blocking,
        warmup.py; never while a step runs: refresh_speeds holds model_lock). `progress`
        hears of each forward (start-up draws a bar with it)."""
        speeds = measure_speeds(
            self._runner, self.vocab_size, warmup_max_prompt_tokens(self.max_context), progress
        )
        self._decode_tps, self._prefill_tps = speeds
        self._batch_decode_tps = self._batch_decode_tps or self._decode_tps

    async def refresh_speeds(
        self, interval_s: float = SPEED_REFRESH_S, max_interval_s: float = SPEED_REFRESH_MAX_S
    ) -> None:
        """Forever: measure the speeds again (a warm-up) when the engine is idle and no
        request sampled them for `interval_s`; while it stays idle, the wait doubles up to
        `max_interval_s`. Run it in the peer's nursery."""
        wait = interval_s
        seen = self._speed_samples
        while True:
            await trio.sleep(wait)
            if self._speed_samples != seen or self._running:
                wait = interval_s  # requests keep the speeds fresh
            else:
                async with self.model_lock:
                    await trio.to_thread.run_sync(self.warmup)
                wait = min(2 * wait, max_interval_s)
            seen = self._speed_samples

    # -- requests --------------------------------------------------------------------------

    def stream(
        self, token_ids: Sequence[int], params: SamplingParams, *, cache_salt: bytes | None = None
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        """Generate: yields a TokenEvent per token, then one Completion, last.

        Validates now (InvalidRequest). Close the iterator (or run it to the end) to
        release the request: `async with contextlib.aclosing(engine.stream(...))`.
        With `cache_salt` the request is private: it shares cached blocks only with
        requests of the same salt, and its blocks are never announced.
        """
        tokens = self.validate(token_ids, params)
        return self._run(tokens, params, cache_salt)

    async def generate(
        self, token_ids: Sequence[int], params: SamplingParams, *, cache_salt: bytes | None = None
    ) -> Completion:
        """Generate and return only the Completion."""
        agen = self.stream(token_ids, params, cache_salt=cache_salt)
        try:
            async for item in agen:
                if isinstance(item, Completion):
                    return item
        finally:
            await agen.aclose()
        raise EngineError("generation ended without a completion")  # unreachable by design

    async def _run(
        self, tokens: list[int], params: SamplingParams, salt: bytes | None
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        queued = len(tokens) - self._reusable_tokens(tokens, salt)
        tracker = StopTracker(self.tokenizer, params.stop)
        device = self._runner.device
        req = RequestState(self._next_rid, tokens, params, queued, tracker, device, salt)
        self._next_rid += 1
        self._stats["requests"] += 1
        self._running += 1
        self._queued_prompt_tokens += queued
        self._waiting.append(req)
        outcome = "cancelled_requests"
        try:
            while True:
                while req.outbox:
                    yield req.outbox.popleft()
                if req.error is not None:
                    err = req.error
                    raise EngineError(f"generation failed: {type(err).__name__}: {err}") from err
                if req.finish is not None:
                    break
                await self._advance()
            total = time.perf_counter() - req.start
            decode_s = total - req.ttft
            assert req.match is not None
            usage = Usage(
                prompt_tokens=len(tokens),
                cached_tokens=req.match.num_tokens,
                completion_tokens=len(req.generated),
                ttft_s=req.ttft,
                decode_tokens_per_s=(len(req.generated) - 1) / decode_s if decode_s > 0 else 0.0,
                total_s=total,
            )
            outcome = "completed_requests"
            yield Completion(tuple(req.generated), req.tracker.text, req.finish, usage)
        except EngineError:
            outcome = "failed_requests"
            raise
        except Exception as exc:  # tokenizer failure, say: this request fails, not the engine
            outcome = "failed_requests"
            raise EngineError(f"generation failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._stats[outcome] += 1
            self._running -= 1
            self._queued_prompt_tokens -= req.queued
            req.queued = 0
            if req in self._waiting:
                self._waiting.remove(req)
            self._batch.pop(req.rid, None)  # leaves the batch at the next step
            if req.match is not None:
                self.cache.unlock(req.match)

    async def verify(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
        *, cache_salt: bytes | None = None,
    ) -> Verdict:
        """Check another peer's `output_ids` for `prompt_ids` by teacher forcing (verify.py),
        outside the batch, over the prompt's cached prefix; the output's blocks enter the
        cache only if it verified. InvalidRequest for a bad prompt or params."""
        tokens = self.validate(prompt_ids, params)
        return await verify_output(self, tokens, output_ids, params, cache_salt)

    # -- steps -------------------------------------------------------------------------------

    async def _advance(self) -> None:
        """Run the next step for every request, or wait for the one running."""
        if self._stepping:
            await self._step_done.wait()
            return
        self._stepping = True
        try:
            await trio.lowlevel.checkpoint()  # requests submitted meanwhile join this step
            async with self.model_lock:  # and those while work outside the batch runs
                await self._step()
        finally:
            self._end_step()

    def _end_step(self) -> None:
        self._stepping = False
        self._step_done.set()
        self._step_done = trio.Event()

    def _admit(self) -> None:
        """Move waiting requests into the batch: match late (earlier requests may have
        added blocks), lock the match; the KV copy is made in the step's thread.

        A request whose prompt shares at least one more block with a prompt still being
        read than the cache holds waits for it: that prompt's blocks are inserted when it
        is read, and this one then reuses them instead of computing them a second time
        (requests that share a prefix often arrive together)."""
        now = trio.current_time()
        free = admit_count(len(self._waiting), len(self._batch), self.max_running)
        kept: deque[RequestState] = deque()
        while self._waiting:
            req = self._waiting.popleft()
            if free <= 0 or self._shares_prefill_in_flight(req):
                kept.append(req)
                continue
            free -= 1
            for observe in self.queue_wait_observers:  # metrics: the wait before a first step
                observe(time.perf_counter() - req.start)
            max_blocks = reusable_blocks(len(req.tokens), self.block_size)
            req.match = self.cache.match(req.tokens, now, max_blocks, salt=req.salt)
            self.cache.lock(req.match)
            req.blocks = list(req.match.values)
            req.pos = req.match.num_tokens
            self._batch[req.rid] = req
        self._waiting = kept

    def _shares_prefill_in_flight(self, req: RequestState) -> bool:
        if self.cache.capacity_blocks == 0:
            return False
        want = self._reusable_tokens(req.tokens, req.salt) + self.block_size
        if want > reusable_blocks(len(req.tokens), self.block_size) * self.block_size:
            return False
        head = req.tokens[:want]
        return any(
            other.prefilling and other.salt == req.salt and other.tokens[:want] == head
            for other in self._batch.values()
        )

    def _plan(self) -> StepPlan:
        decoding = [r.rid for r in self._batch.values() if not r.prefilling]
        prefilling = [(r.rid, len(r.tokens) - r.pos) for r in self._batch.values() if r.prefilling]
        return plan_step(decoding, prefilling, self.step_tokens)

    async def _step(self) -> None:
        self._admit()
        plan = self._plan()
        if not plan:
            return
        work: list[tuple[RequestState, list[int], bool]] = []
        for rid in plan.decode:
            req = self._batch[rid]
            work.append((req, [req.generated[-1]], True))
        for rid, n in plan.prefill:
            req = self._batch[rid]
            end = req.pos + n
            work.append((req, req.tokens[req.pos : end], end == len(req.tokens)))
        try:
            sampled, blocks, seconds = await trio.to_thread.run_sync(self._compute, work)
            self._apply(plan, work, sampled, blocks, seconds)
        except Exception as exc:  # torch failure: this step's requests fail, not the engine
            for req, _, _ in work:
                req.error = exc
                self._batch.pop(req.rid, None)
            return
        if self.cache_generated:
            done = [req for req, _, _ in work if req.finish is not None and req.kv is not None]
            if done:
                await self._cache_generated(done)

    def _compute(
        self, work: list[tuple[RequestState, list[int], bool]]
    ) -> tuple[dict[int, int], dict[int, list[torch.Tensor]], float]:
        """Worker thread: build new sequences' KV, run the packed forward, sample, and copy
        out the prompt blocks of prompts read to the end."""
        for req, _, _ in work:
            if req.kv is None:
                assert req.blocks is not None
                capacity = len(req.tokens) + req.params.max_new_tokens
                req.kv = self._runner.new_kv(req.blocks, capacity)
                req.blocks = None
        start = time.perf_counter()
        items: list[tuple[SeqKV, list[int]]] = []
        for req, ids, _ in work:
            assert req.kv is not None
            items.append((req.kv, ids))
        logits = self._runner.forward(items, [want for _, _, want in work])
        sampled: dict[int, int] = {}
        row = 0
        for req, _, want in work:
            if want:
                sampled[req.rid] = sample_token(logits[row], req.params, req.generator)
                row += 1
        seconds = time.perf_counter() - start
        blocks: dict[int, list[torch.Tensor]] = {}
        for (req, _, want), (kv, _) in zip(work, items, strict=True):
            if want and not req.generated and req.match is not None:
                end_block = len(req.tokens) // self.block_size
                blocks[req.rid] = kv.blocks(req.match.num_blocks, end_block, self.block_size)
        return sampled, blocks, seconds

    def _apply(
        self,
        plan: StepPlan,
        work: list[tuple[RequestState, list[int], bool]],
        sampled: dict[int, int],
        blocks: dict[int, list[torch.Tensor]],
        seconds: float,
    ) -> None:
        """Event loop: advance every request of the step by its result."""
        now = trio.current_time()
        self._stats["steps"] += 1
        self._stats["step_tokens"] += plan.num_tokens
        self._stats["max_batch"] = max(self._stats["max_batch"], len(work))
        for req, ids, _ in work:
            if self._batch.get(req.rid) is not req:
                continue  # cancelled during the step
            if req.prefilling:
                req.pos += len(ids)
            if req.rid not in sampled:
                continue
            if not req.generated:  # the prompt is read: first token, cache its blocks
                assert req.match is not None
                req.ttft = time.perf_counter() - req.start
                self._queued_prompt_tokens -= req.queued
                req.queued = 0
                n = len(req.tokens)
                self._stats["prompt_tokens"] += n
                self._stats["cached_tokens"] += req.match.num_tokens
                self._stats["computed_prompt_tokens"] += n - req.match.num_tokens
                first, got = req.match.num_blocks, blocks.get(req.rid, [])
                self._insert(req.tokens, first, got, now, req.salt)
            req.generated.append(sampled[req.rid])
            self._stats["generated_tokens"] += 1
            self._emit(req)
        prefill_tokens = sum(n for _, n in plan.prefill)
        speeds = StepSpeeds(self._prefill_tps, self._decode_tps, self._batch_decode_tps)
        speeds, sampled_prefill = observe_step(speeds, prefill_tokens, len(plan.decode), seconds)
        self._prefill_tps, self._decode_tps, self._batch_decode_tps = speeds
        self._speed_samples += int(sampled_prefill)

    def _emit(self, req: RequestState) -> None:
        """Queue the newest token's event; finish the request on EOS, length or a stop."""
        tok = req.generated[-1]
        finish = None
        if tok in self._eos:
            finish = "stop"
        elif len(req.generated) >= req.params.max_new_tokens:
            finish = "length"
        delta, stopped = req.tracker.push(req.generated, final=finish is not None)
        if stopped:
            finish = "stop"
        req.outbox.append(TokenEvent(len(req.generated) - 1, tok, delta))
        if finish is not None:
            req.finish = finish
            self._batch.pop(req.rid, None)

    def _insert(self, tokens: Sequence[int], first_block: int, blocks: list[torch.Tensor],
                now: float, salt: bytes | None) -> None:
        """Insert tokens' full blocks from `first_block` on (values from `blocks`), salted."""
        if not blocks:
            return
        end = (first_block + len(blocks)) * self.block_size
        self.cache.insert(
            tokens[:end],
            lambda b: blocks[b - first_block],  # only called for blocks not cached meanwhile
            now,
            salt=salt,
        )

    async def _cache_generated(self, done: list[RequestState]) -> None:
        """Insert the blocks that finished requests' generated tokens completed."""
        spans = []
        for req in done:
            assert req.kv is not None and req.match is not None
            full = req.tokens + req.generated[:-1]  # the last token was never fed
            spans.append((full, len(req.tokens) // self.block_size, req.kv, req.salt))

        def copy() -> list[list[torch.Tensor]]:
            return [
                kv.blocks(first, len(full) // self.block_size, self.block_size)
                for full, first, kv, _ in spans
            ]

        copies = await trio.to_thread.run_sync(copy)
        now = trio.current_time()
        for (full, first, _, salt), blocks in zip(spans, copies, strict=True):
            self._insert(full, first, blocks, now, salt)


def load_engine(
    name: str,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
    warmup: bool = True,
    **load: Any,
) -> Engine:
    """Load a model and build its engine. Heavy and blocking: call via trio.to_thread.
    `load` goes to load_model (dtype, device, threads)."""
    engine = Engine(load_model(name, **load), cache_bytes, block_size)
    if warmup:
        engine.warmup()
    return engine
