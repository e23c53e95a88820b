"""Engine: one model with a prefix KV cache, serving concurrent requests in one batch
(batch.py's BatchLoop). This module loads the model, validates requests, answers the
router's queries (load(), local matches, statistics()), keeps the speeds measured, and
checks other peers' outputs (verify.py). It is api.py's GeneratingEngine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
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
from .batch import BatchLoop
from .compute_thread import compute_thread
from .kv import DEFAULT_CACHE_BYTES, KVLayout
from .model import LoadedModel, load_model
from .radix import RadixCache
from .requests import StopTracker, encode_prompt, validate_prompt
from .runner import Runner
from .scheduler import DEFAULT_MAX_RUNNING, DEFAULT_STEP_TOKENS
from .speeds import warmup_max_prompt_tokens
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


class Engine(BatchLoop):
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
        self._loaded = loaded
        self._model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.model_id
        self.vocab_size = loaded.vocab_size
        self.max_context = loaded.max_context
        self.hasher = BlockHasher(loaded.model_id, block_size)
        itemsize = next(self._model.parameters()).element_size()
        self.layout = KVLayout(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, block_size, itemsize
        )
        self.cache_bytes = cache_bytes
        cache: RadixCache[torch.Tensor] = RadixCache(
            block_size, self.layout.capacity_blocks(cache_bytes), self.hasher
        )
        super().__init__(
            Runner(self._model, self.layout, loaded.decode_step, loaded.threads), cache,
            block_size,
            loaded.eos_token_ids, step_tokens, max_running, cache_generated,
        )
        self._stats.update(verifications=0, verifications_failed=0, verified_tokens=0)

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
        """Load `name` on the compute thread (seconds; minutes on first use) and warm it
        up. `load` goes to load_model (dtype, device, threads)."""
        return await compute_thread().run(
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
            waiting_requests=len(self._queue.waiting),
            batch_decode_tokens_per_s=self._batch_decode_tps,
            batch_slots=self.max_running,
            step_tokens=self.step_tokens,
        )

    def statistics(self) -> dict[str, int | float]:
        """Request and token counters, speeds, and the cache's statistics (prefixed cache_)."""
        out: dict[str, int | float] = dict(self._stats)
        out["running_requests"] = self._running
        out["waiting_requests"] = len(self._queue.waiting)
        out["batch_size"] = len(self._queue.batch)
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
            self.runner, self.vocab_size, warmup_max_prompt_tokens(self.max_context), progress
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
                    await compute_thread().run(self.warmup)
                wait = min(2 * wait, max_interval_s)
            seen = self._speed_samples

    # -- requests --------------------------------------------------------------------------

    def stream(
        self, token_ids: Sequence[int], params: SamplingParams, *, cache_salt: bytes | None = None,
        background: bool = False,
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        """Generate: yields a TokenEvent per token, then one Completion, last.

        Validates now (InvalidRequest). Close the iterator (or run it to the end) to
        release the request: `async with contextlib.aclosing(engine.stream(...))`.
        With `cache_salt` the request is private: it shares cached blocks only with
        requests of the same salt, and its blocks are never announced. A `background`
        request (served for another peer) joins the batch and reads its prompt only after
        the requests of this peer's own clients.
        """
        tokens = self.validate(token_ids, params)
        tracker = StopTracker(self.tokenizer, params.stop)
        return self._run(tokens, params, cache_salt, tracker, background)

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

    async def verify(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
        *, cache_salt: bytes | None = None,
    ) -> Verdict:
        """Check another peer's `output_ids` for `prompt_ids` by teacher forcing (verify.py),
        outside the batch, over the prompt's cached prefix; it adds nothing to the cache (an
        entry's summary must not show what it verified). InvalidRequest for a bad prompt
        or params."""
        tokens = self.validate(prompt_ids, params)
        verdict = await verify_output(self, tokens, output_ids, params, cache_salt)
        self._stats["verifications"] += 1
        self._stats["verifications_failed"] += not verdict.ok
        self._stats["verified_tokens"] += verdict.checked_tokens
        return verdict


def load_engine(
    name: str,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
    warmup: bool = True,
    **load: Any,
) -> Engine:
    """Load a model and build its engine. Heavy and blocking: call on the compute thread.
    `load` goes to load_model (dtype, device, threads)."""
    engine = Engine(load_model(name, **load), cache_bytes, block_size)
    if warmup:
        engine.warmup()
    return engine
