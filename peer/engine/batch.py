"""Continuous batching over the radix cache: the waiting requests, the batch, and the step
that advances them all.

Every step is one forward over the next token of every decoding request plus prefill
chunks of new prompts, within a token budget (scheduler.py), computed by runner.py in a
worker thread. There is no background task: each request's own task either runs the next
step for everybody (when no step is running) or waits for the running one, then hands out
its own new tokens. Admission happens between steps, and a cancelled request leaves the
batch at the next step. Work outside the batch (verification chunks, a warm-up) takes the
model lock in turn with the steps. The radix tree is touched only on the event loop.
Matched blocks stay locked for the whole request. A request still computes only its
uncached suffix: its sequence buffer starts as a copy of the matched blocks.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from dataclasses import replace

import torch
import trio

from .api import SEED_BITS, Completion, EngineError, SamplingParams, TokenEvent, Usage
from .compute_thread import compute_thread
from .radix import RadixCache
from .requests import RequestState, StopTracker, sample_token
from .runner import Runner, SeqKV
from .scheduler import (
    BatchQueue,
    StepPlan,
    reusable_blocks,
    reusable_tokens,
    waits_for_shared_prefill,
)
from .speeds import StepSpeeds, observe_step

__all__ = ["BatchLoop"]


class BatchLoop:
    """The batching half of an engine (engine.py's Engine builds on it): requests go in
    with `_run`, scheduler.BatchQueue says who joins and what a step computes, steps
    advance them, and read prompts' blocks go into `cache`."""

    def __init__(
        self,
        runner: Runner,
        cache: RadixCache[torch.Tensor],
        block_size: int,
        eos_token_ids: Collection[int],
        step_tokens: int,
        max_running: int,
        cache_generated: bool,
    ) -> None:
        if step_tokens < 1 or max_running < 1:
            raise ValueError("step_tokens and max_running must be >= 1")
        self.runner = runner
        self.cache = cache
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # Generated tokens' KV comes from one-token decode steps, which may differ from a
        # prefill in the last bits; off by default so cached == uncached stays exact.
        self.cache_generated = cache_generated
        self.step_tokens = step_tokens
        self.max_running = max_running
        # Who waits, who is in the batch; requests served for other peers go after our own.
        self._queue: BatchQueue[RequestState] = BatchQueue(rank=_background_rank)
        # Called with each request's wait before its first step (metrics: queue wait).
        self.queue_wait_observers: list[Callable[[float], None]] = []
        self._next_rid = 0
        # Draws the seed of a sampled request that came without one (a local client's).
        self.seed_rng = random.Random()
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
        }

    def _reusable_tokens(self, tokens: Sequence[int], salt: bytes | None) -> int:
        return reusable_tokens(self.cache.peek(tokens, salt=salt), len(tokens), self.block_size)

    async def _run(
        self, tokens: list[int], params: SamplingParams, salt: bytes | None,
        tracker: StopTracker, background: bool = False,
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        """One validated request from submission to its Completion: queued, admitted at a
        step, advanced by steps (its own task runs them or waits for the running one).
        A `background` request joins the batch and reads its prompt after the others."""
        queued = len(tokens) - self._reusable_tokens(tokens, salt)
        if params.temperature > 0.0 and params.seed is None:  # every draw is seeded
            params = replace(params, seed=self.seed_rng.getrandbits(SEED_BITS))
        req = RequestState(self._next_rid, tokens, params, queued, tracker, salt)
        req.background = background
        self._next_rid += 1
        self._stats["requests"] += 1
        self._running += 1
        self._queued_prompt_tokens += queued
        self._queue.submit(req)
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
            self._queue.leave(req)  # a running one leaves the batch at the next step
            if req.match is not None:
                self.cache.unlock(req.match)

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

        def join(req: RequestState) -> None:
            for observe in self.queue_wait_observers:  # metrics: the wait before a first step
                observe(time.perf_counter() - req.start)
            max_blocks = reusable_blocks(len(req.tokens), self.block_size)
            req.match = self.cache.match(req.tokens, now, max_blocks, salt=req.salt)
            self.cache.lock(req.match)
            req.blocks = list(req.match.values)
            req.pos = req.match.num_tokens

        self._queue.admit(self.max_running, join, self._shares_prefill_in_flight)

    def _shares_prefill_in_flight(self, req: RequestState) -> bool:
        if self.cache.capacity_blocks == 0:
            return False
        return waits_for_shared_prefill(
            req.tokens, self._reusable_tokens(req.tokens, req.salt), self.block_size,
            (o.tokens for o in self._queue.batch.values() if o.prefilling and o.salt == req.salt),
        )

    async def _step(self) -> None:
        self._admit()
        plan = self._queue.plan(self.step_tokens)
        if not plan:
            return
        work: list[tuple[RequestState, list[int], bool]] = []
        for rid in plan.decode:
            req = self._queue.batch[rid]
            work.append((req, [req.generated[-1]], True))
        for rid, n in plan.prefill:
            req = self._queue.batch[rid]
            end = req.pos + n
            work.append((req, req.tokens[req.pos : end], end == len(req.tokens)))
        try:
            sampled, blocks, seconds = await compute_thread().run(self._compute, work)
            self._apply(plan, work, sampled, blocks, seconds)
        except Exception as exc:  # torch failure: this step's requests fail, not the engine
            for req, _, _ in work:
                req.error = exc
                self._queue.finish(req.rid)
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
                req.kv = self.runner.new_kv(req.blocks, capacity)
                req.blocks = None
        start = time.perf_counter()
        items: list[tuple[SeqKV, list[int]]] = []
        for req, ids, _ in work:
            assert req.kv is not None
            items.append((req.kv, ids))
        logits = self.runner.forward(items, [want for _, _, want in work])
        sampled: dict[int, int] = {}
        row = 0
        for req, _, want in work:
            if want:
                sampled[req.rid] = sample_token(logits[row], req.params, req.seed,
                                                req.next_position)
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
            if self._queue.batch.get(req.rid) is not req:
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
                self.insert_blocks(req.tokens, first, got, now, req.salt)
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
        if tok in self.eos_token_ids:
            finish = "stop"
        elif len(req.generated) >= req.params.max_new_tokens:
            finish = "length"
        delta, stopped = req.tracker.push(req.generated, final=finish is not None)
        if stopped:
            finish = "stop"
        req.outbox.append(TokenEvent(len(req.generated) - 1, tok, delta))
        if finish is not None:
            req.finish = finish
            self._queue.finish(req.rid)

    def insert_blocks(self, tokens: Sequence[int], first_block: int, blocks: list[torch.Tensor],
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

        copies = await compute_thread().run(copy)
        now = trio.current_time()
        for (full, first, _, salt), blocks in zip(spans, copies, strict=True):
            self.insert_blocks(full, first, blocks, now, salt)


def _background_rank(req: RequestState) -> int:
    return 1 if req.background else 0
