"""Generation with prefix reuse: match the radix cache, compute only the uncached suffix.

Torch runs off the Trio event loop, one step (a prefill chunk or one decode token) per
`trio.to_thread.run_sync` call behind a CapacityLimiter(1): requests interleave token by
token and a cancelled request stops at its next step. The radix tree is touched only on
the event loop. Matched blocks stay locked for the whole request.
"""

from __future__ import annotations

import operator
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import torch
import trio

from protocols.blocks import DEFAULT_BLOCK_SIZE, BlockHasher

from .kv import DEFAULT_CACHE_BYTES, KVLayout, blocks_from_cache, cache_from_blocks
from .model import LoadedModel, load_model
from .radix import RadixCache
from .requests import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS_PER_TOKEN,
    Completion,
    EngineError,
    EngineLoad,
    InvalidRequest,
    SamplingParams,
    StopTracker,
    TokenEvent,
    Usage,
    sample_token,
)
from .speeds import ewma, prefill_speed_sample, warmup_prefill_speed
from .verify import VERIFY_CHUNK_TOKENS, Finding, Verdict, check_logits, check_structure

PREFILL_CHUNK_TOKENS = 512  # ~1 s of SmolLM2 prefill on 2 cores: the grain of interleaving/cancel
WARMUP_PROMPT_TOKENS = 64  # enough to measure prefill speed without delaying start-up
WARMUP_DECODE_TOKENS = 4
# Speeds that no request refreshed for this long are measured again while the engine is
# idle. A peer that once measured itself slow (start-up on a busy machine) is sent no work
# by anyone, itself included, so no request would ever correct it (seen: one of four
# tiny-random peers served 0 of 158 requests).
SPEED_REFRESH_S = 30.0
SPEED_REFRESH_MAX_S = 600.0  # an idle peer's re-measurements back off to this (doubling)


class _Sequence:
    """Per-request torch state, touched only inside worker-thread steps."""

    __slots__ = ("cache", "generator")

    def __init__(self, cache: Any, seed: int | None) -> None:
        self.cache = cache
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)


class Engine:
    """One model with a prefix KV cache, serving requests from Trio tasks."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_generated: bool = False,
    ) -> None:
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
        self.cache_bytes = cache_bytes
        self.cache: RadixCache[torch.Tensor] = RadixCache(
            block_size, self.layout.capacity_blocks(cache_bytes), self.hasher
        )
        # Generated tokens' KV comes from one-token decode steps, which may differ from a
        # prefill in the last bits; off by default so cached == uncached stays exact.
        self.cache_generated = cache_generated
        self._eos = frozenset(loaded.eos_token_ids)
        self._limiter = trio.CapacityLimiter(1)
        self._queued_prompt_tokens = 0
        self._running = 0
        self._prefill_tps = 0.0
        self._decode_tps = 0.0
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
    ) -> Engine:
        """An engine with a fresh, empty cache around an already loaded model."""
        return cls(loaded, cache_bytes, block_size, cache_generated)

    @classmethod
    async def open(
        cls,
        name: str,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> Engine:
        """Load `name` in a worker thread (seconds; minutes on first use) and warm it up."""
        return await trio.to_thread.run_sync(load_engine, name, cache_bytes, block_size)

    # -- tokens and text -----------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a text prompt, or of chat messages through the chat template."""
        max_chars = self.max_context * MAX_PROMPT_CHARS_PER_TOKEN
        if isinstance(prompt, str):
            if len(prompt) > max_chars:
                raise InvalidRequest(f"prompt has {len(prompt)} characters, limit {max_chars}")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not isinstance(prompt, Sequence) or not 1 <= len(prompt) <= MAX_CHAT_MESSAGES:
            raise InvalidRequest(f"chat needs 1 to {MAX_CHAT_MESSAGES} messages")
        total = 0
        for m in prompt:
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise InvalidRequest("each chat message needs string 'role' and 'content'")
            total += len(m["content"])
        if total > max_chars:
            raise InvalidRequest(f"chat has {total} characters, limit {max_chars}")
        try:
            text = self.tokenizer.apply_chat_template(
                list(prompt), tokenize=False, add_generation_prompt=True
            )
        except (ValueError, TypeError, KeyError) as exc:  # jinja errors subclass these or not
            raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or InvalidRequest naming the limit."""
        params.validate()
        try:
            tokens = [operator.index(t) for t in token_ids]
        except TypeError:
            raise InvalidRequest("token ids must be integers") from None
        if not tokens:
            raise InvalidRequest("the prompt is empty: at least one token is needed")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            bad = next(t for t in tokens if not 0 <= t < self.vocab_size)
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(tokens) + params.max_new_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(tokens)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens"
            )
        return tokens

    # -- queries for the router ----------------------------------------------------------

    def local_match_tokens(self, token_ids: Sequence[int], cache_salt: bytes | None = None) -> int:
        """Tokens of the longest cached prefix (block-aligned); no side effect."""
        return self.cache.peek(token_ids, salt=cache_salt)

    def _reusable_tokens(self, tokens: Sequence[int], salt: bytes | None) -> int:
        # At least one prompt token is always computed: its logits give the first token.
        last = (len(tokens) - 1) // self.block_size * self.block_size
        return min(self.cache.peek(tokens, salt=salt), last)

    def load(self) -> EngineLoad:
        """Queued (uncached) prompt tokens, running requests and measured speeds."""
        return EngineLoad(
            self._queued_prompt_tokens, self._running, self._prefill_tps, self._decode_tps
        )

    def statistics(self) -> dict[str, int | float]:
        """Request and token counters, speeds, and the cache's statistics (prefixed cache_)."""
        out: dict[str, int | float] = dict(self._stats)
        out["running_requests"] = self._running
        out["queued_prompt_tokens"] = self._queued_prompt_tokens
        out["prefill_tokens_per_s"] = self._prefill_tps
        out["decode_tokens_per_s"] = self._decode_tps
        out["cache_bytes"] = self.cache_bytes
        out["cache_block_bytes"] = self.layout.block_bytes
        for key, value in self.cache.statistics().items():
            out[f"cache_{key}"] = value
        return out

    def warmup(self) -> None:
        """Run short prefills and a few decode steps to seed the speed estimates (blocking)."""
        params = SamplingParams(max_new_tokens=WARMUP_DECODE_TOKENS)
        ids = self._warmup_ids(WARMUP_PROMPT_TOKENS)
        for _ in range(2):  # the first pass pays one-time costs; the second is the sample
            self._decode_tps = 0.0
            seq = _Sequence(cache_from_blocks([]), 0)
            tok = self._prefill_step(seq, ids, params)
            assert tok is not None
            for _ in range(WARMUP_DECODE_TOKENS):
                tok = self._decode_step(seq, tok, params)
        self._prefill_tps = warmup_prefill_speed(
            self._time_cold_prefill, self._decode_tps, WARMUP_PROMPT_TOKENS, self.max_context // 2
        )

    def _time_cold_prefill(self, n: int) -> float:
        start = time.perf_counter()
        self._forward(_Sequence(cache_from_blocks([]), 0), self._warmup_ids(n))
        return time.perf_counter() - start

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
                async with self._limiter:
                    await trio.to_thread.run_sync(self.warmup)
                wait = min(2 * wait, max_interval_s)
            seen = self._speed_samples

    def _warmup_ids(self, n: int) -> list[int]:
        return [i % self.vocab_size for i in range(1, n + 1)]

    # -- torch steps (worker thread) -----------------------------------------------------

    def _forward(self, seq: _Sequence, ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = self._model(
                input_ids=torch.tensor([list(ids)], dtype=torch.long),
                cache=seq.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _prefill_step(
        self, seq: _Sequence, ids: Sequence[int], params: SamplingParams | None
    ) -> int | None:
        """Feed a prompt chunk; on the last chunk (params given) sample the first token."""
        start = time.perf_counter()
        logits = self._forward(seq, ids)
        token = None if params is None else sample_token(logits, params, seq.generator)
        sample = prefill_speed_sample(
            len(ids), time.perf_counter() - start, self._decode_tps
        )
        if sample is not None:
            self._prefill_tps = ewma(self._prefill_tps, sample)
            self._speed_samples += 1
        return token

    def _decode_step(self, seq: _Sequence, token: int, params: SamplingParams) -> int:
        start = time.perf_counter()
        nxt = sample_token(self._forward(seq, (token,)), params, seq.generator)
        self._decode_tps = ewma(self._decode_tps, 1.0 / (time.perf_counter() - start))
        return nxt

    async def _cache_blocks(
        self, tokens: Sequence[int], seq: _Sequence, first_block: int, salt: bytes | None = None
    ) -> None:
        """Insert tokens' full blocks from `first_block` on, with KV copied out of `seq`."""
        end_block = len(tokens) // self.block_size
        if end_block <= first_block:
            return
        blocks = await trio.to_thread.run_sync(
            blocks_from_cache, seq.cache, first_block, end_block, self.block_size
        )
        self.cache.insert(
            tokens[: end_block * self.block_size],
            lambda b: blocks[b - first_block],  # only called for blocks not cached meanwhile
            trio.current_time(),
            salt=salt,
        )

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
        self, tokens: list[int], params: SamplingParams, salt: bytes | None = None
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        start = time.perf_counter()
        n = len(tokens)
        queued = n - self._reusable_tokens(tokens, salt)
        self._stats["requests"] += 1
        self._running += 1
        self._queued_prompt_tokens += queued
        match = None
        outcome = "cancelled_requests"
        try:
            seq: _Sequence | None = None
            first: int | None = None
            pos = 0
            while first is None:
                async with self._limiter:
                    if seq is None:  # match late: earlier requests may have added blocks
                        max_blocks = (n - 1) // self.block_size
                        match = self.cache.match(
                            tokens, trio.current_time(), max_blocks, salt=salt
                        )
                        self.cache.lock(match)
                        pos = match.num_tokens
                        seq = await trio.to_thread.run_sync(
                            lambda m=match: _Sequence(cache_from_blocks(m.values), params.seed)
                        )
                    end = min(n, pos + PREFILL_CHUNK_TOKENS)
                    chunk = tokens[pos:end]
                    first = await trio.to_thread.run_sync(
                        self._prefill_step, seq, chunk, params if end == n else None
                    )
                    pos = end
                    if first is not None:
                        first_block = match.num_blocks if match else 0
                        await self._cache_blocks(tokens, seq, first_block, salt)
            assert match is not None and seq is not None
            self._queued_prompt_tokens -= queued
            queued = 0
            self._stats["prompt_tokens"] += n
            self._stats["cached_tokens"] += match.num_tokens
            self._stats["computed_prompt_tokens"] += n - match.num_tokens
            ttft = time.perf_counter() - start
            generated = [first]
            self._stats["generated_tokens"] += 1
            tracker = StopTracker(self.tokenizer, params.stop)
            finish: str | None = None
            while True:
                tok = generated[-1]
                if tok in self._eos:
                    finish = "stop"
                elif len(generated) >= params.max_new_tokens:
                    finish = "length"
                delta, stopped = tracker.push(generated, final=finish is not None)
                if stopped:
                    finish = "stop"
                yield TokenEvent(len(generated) - 1, tok, delta)
                if finish is not None:
                    break
                async with self._limiter:
                    nxt = await trio.to_thread.run_sync(self._decode_step, seq, tok, params)
                generated.append(nxt)
                self._stats["generated_tokens"] += 1
            if self.cache_generated:
                async with self._limiter:
                    await self._cache_blocks(
                        tokens + generated[:-1], seq, n // self.block_size, salt
                    )
            total = time.perf_counter() - start
            decode_s = total - ttft
            usage = Usage(
                prompt_tokens=n,
                cached_tokens=match.num_tokens,
                completion_tokens=len(generated),
                ttft_s=ttft,
                decode_tokens_per_s=(len(generated) - 1) / decode_s if decode_s > 0 else 0.0,
                total_s=total,
            )
            outcome = "completed_requests"
            yield Completion(tuple(generated), tracker.text, finish, usage)
        except (trio.Cancelled, GeneratorExit, KeyboardInterrupt):
            raise
        except Exception as exc:  # torch or tokenizer failure: this request fails, not the engine
            outcome = "failed_requests"
            raise EngineError(f"generation failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._stats[outcome] += 1
            self._running -= 1
            self._queued_prompt_tokens -= queued
            if match is not None:
                self.cache.unlock(match)

    # -- verification (peer/engine/verify.py) -------------------------------------------

    async def verify(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: bytes | None = None,
    ) -> Verdict:
        """Check another peer's `output_ids` for `prompt_ids` by teacher forcing: one
        forward over prompt + output, the prompt's cached prefix reused, torch off the
        event loop. The output's blocks enter the cache only if it verified.

        InvalidRequest for a bad prompt or params (the output itself is what is judged)."""
        start = time.perf_counter()
        tokens = self.validate(prompt_ids, params)
        try:
            output = [operator.index(t) for t in output_ids]
        except TypeError:
            return Verdict(False, 0, "output token ids must be integers", 0)
        found = await trio.to_thread.run_sync(  # stop strings decode every prefix: O(n^2)
            check_structure, output, params, self.vocab_size, self._eos, self.decode
        )
        if found is not None:
            return self._verdict(found, 0, 0, start)
        n = len(tokens)
        full = tokens + output[:-1]  # the last output token is predicted, never fed
        match = None
        pos = 0
        try:
            async with self._limiter:
                max_blocks = (n - 1) // self.block_size  # the last prompt token gives logits
                match = self.cache.match(tokens, trio.current_time(), max_blocks, salt=cache_salt)
                self.cache.lock(match)
                seq = await trio.to_thread.run_sync(
                    lambda m=match: _Sequence(cache_from_blocks(m.values), 0)
                )
            pos = match.num_tokens
            while found is None and pos < len(full):
                end = min(len(full), pos + VERIFY_CHUNK_TOKENS)
                async with self._limiter:
                    found = await trio.to_thread.run_sync(
                        self._score_step, seq, full, pos, end, n, output, params
                    )
                pos = end
            limit = len(full) if found is None else min(pos, n)
            async with self._limiter:
                await self._cache_blocks(full[:limit], seq, match.num_blocks, cache_salt)
        except (trio.Cancelled, GeneratorExit, KeyboardInterrupt):
            raise
        except Exception as exc:  # torch failure: this verification fails, not the engine
            raise EngineError(f"verification failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if match is not None:
                self.cache.unlock(match)
        checked = len(output) if found is None else found.index + 1
        return self._verdict(found, checked, match.num_tokens, start)

    def _score_step(
        self,
        seq: _Sequence,
        full: list[int],
        pos: int,
        end: int,
        n: int,
        output: list[int],
        params: SamplingParams,
    ) -> Finding | None:
        """Feed full[pos:end]; check the output tokens its rows predict (worker thread)."""
        keep = end - max(pos, n - 1)  # rows from the last prompt token on predict outputs
        with torch.inference_mode():
            out = self._model(
                input_ids=torch.tensor([full[pos:end]], dtype=torch.long),
                cache=seq.cache,
                use_cache=True,
                logits_to_keep=max(keep, 1),  # 0 would mean "all rows"
            )
        if keep <= 0:
            return None
        return check_logits(out.logits[0, -keep:], output, params, max(pos, n - 1) - (n - 1))

    def _verdict(
        self, found: Finding | None, checked: int, cached: int, start: float
    ) -> Verdict:
        self._stats["verifications"] += 1
        self._stats["verified_tokens"] += checked
        if found is not None:
            self._stats["verifications_failed"] += 1
        elapsed = time.perf_counter() - start
        if found is None:
            return Verdict(True, None, "verified", checked, cached, elapsed)
        return Verdict(False, found.index, found.detail, checked, cached, elapsed)


def load_engine(
    name: str,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
    warmup: bool = True,
) -> Engine:
    """Load a model and build its engine. Heavy and blocking: call via trio.to_thread."""
    engine = Engine(load_model(name), cache_bytes, block_size)
    if warmup:
        engine.warmup()
    return engine
