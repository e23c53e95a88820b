"""The engine's API without torch: request, sampling, usage, load and verdict types, and
the one interface the rest of the peer holds an engine by:

  EngineView        what gossip, lookup, probing and the views read: model id, block size,
                    hasher, the block cache (CacheView), load(), the local match;
                    generating() says whether it can generate (a cache-only engine cannot)
  GeneratingEngine  an EngineView that generates: what serving, the pipeline and the
                    inference service use (the HTTP face reaches it through the peer)

peer/engine/engine.py's Engine is a GeneratingEngine; peer/engine/cache_only.py's
CacheOnlyEngine an EngineView. The HTTP face, the pipeline and the simulator can import
this module alone (tests/test_purity.py checks that it loads no ML framework).
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from protocols.blocks import BlockHasher

from .radix import CacheEvent

__all__ = [
    "ATTENTIONS",
    "AUTO_DTYPE",
    "DEVICES",
    "DTYPES",
    "MAX_CHAT_MESSAGES",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_CHARS_PER_TOKEN",
    "MAX_SEED",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TEMPERATURE",
    "QUANT_FORMATS",
    "SEED_BITS",
    "CacheView",
    "Completion",
    "ContextTooLong",
    "EngineError",
    "EngineLoad",
    "EngineView",
    "GeneratingEngine",
    "InvalidRequest",
    "ModelLoadError",
    "SamplingParams",
    "TokenEvent",
    "Usage",
    "Verdict",
    "Verify",
]

MAX_NEW_TOKENS = 4096  # ~5 min of SmolLM2 decode on 2 cores: one request can't hold a peer longer
MAX_STOP_STRINGS = 8  # OpenAI allows 4; bounds the per-token stop-string check
MAX_STOP_CHARS = 256  # one stop string longer than this is a mistake, not a delimiter
MAX_TEMPERATURE = 100.0  # beyond this sampling is uniform noise; also rejects inf
MAX_SEED = (1 << 63) - 1  # a signed 64-bit int: what the wire and torch both carry
SEED_BITS = 63  # a seed drawn for a sampled request that came without one: below MAX_SEED
MAX_PROMPT_CHARS_PER_TOKEN = 32  # longer text than this x max_context can't fit: don't tokenize
MAX_CHAT_MESSAGES = 1024  # bounds the chat-template work for one request
# Weight-only quantized formats (quant.py): CPU only, bfloat16 activations.
QUANT_FORMATS = ("int8", "int4")
AUTO_DTYPE = "auto"  # model.py's choose_dtype: int4 for the embedded 4-bit SmolLM2 on
#   AVX-512 CPUs with native bfloat16, bfloat16 where the hardware has it, else float32
DTYPES = (AUTO_DTYPE, "float32", "bfloat16", "float16", *QUANT_FORMATS)  # float16: not CPU
DEVICES = ("auto", "cpu", "cuda", "mps")  # auto: cuda, then mps, then cpu
# Attention kernels (runner.py): transformers' SDPA, or fixed_attention.py's, whose rows
# round alike in every call; auto: fixed where the products are row-invariant too (the
# quantized formats), so that batched and cached answers are the sequential ones.
ATTENTIONS = ("auto", "sdpa", "fixed")


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


class EngineError(Exception):
    """The engine could not serve a request."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is invalid; the message names the limit it broke."""


class ContextTooLong(InvalidRequest):
    """The prompt plus max_new_tokens do not fit the model's context window."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context: int) -> None:
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {context} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context = context


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. temperature 0 is greedy. A sampled request is always drawn with a
    seed (sampling.py's keyed sampler): this one, or one the entry or engine chooses."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise InvalidRequest naming the broken limit."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidRequest(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidRequest(
                f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}"
            )
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidRequest(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequest(f"seed must be an int in [0, {MAX_SEED}], got {self.seed!r}")
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop must be a tuple of at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise InvalidRequest(
                    f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {s!r}"
                )


@dataclass(frozen=True)
class Usage:
    """What a request cost. ttft_s counts from submission (queueing included)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it adds (may be empty while a stop string is pending)."""

    index: int
    token_id: int
    text: str


@dataclass(frozen=True)
class Completion:
    """The finished request. finish_reason: "stop" (EOS or a stop string) or "length"."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage


@dataclass(frozen=True)
class EngineLoad:
    """What the router needs: queued work and measured speeds (0.0 = not measured yet).

    decode_tokens_per_s is one stream's speed (1 / step time) at the current batch;
    batch_decode_tokens_per_s is all streams together; waiting_requests have not been
    admitted into the batch yet (admission happens between steps; running_requests counts
    them too). batch_slots and step_tokens are the batch's bounds (max_running and the
    tokens a step computes); batch_slots 0 says the engine does not batch. The summary
    carries all of it (protocols/summary.py) to the cost model (peer/routing/cost.py).
    """

    queued_prompt_tokens: int
    running_requests: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    waiting_requests: int = 0
    batch_decode_tokens_per_s: float = 0.0
    batch_slots: int = 0
    step_tokens: int = 0


@dataclass(frozen=True)
class Verdict:
    """The result of verifying another peer's output (peer/engine/verify.py).

    first_bad_index: the first output position that fails (a token, or where the answer
    should have stopped or should have gone on), None when ok. checked_tokens: output
    tokens re-scored. cached_tokens: prompt tokens taken from the local cache.
    """

    ok: bool
    first_bad_index: int | None
    detail: str
    checked_tokens: int
    cached_tokens: int = 0
    elapsed_s: float = 0.0


class Verify(Protocol):
    """A teacher-forced check of `output_ids` as the answer to `prompt_ids`."""

    def __call__(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams
    ) -> Awaitable[Verdict]: ...


class CacheView(Protocol):
    """What the peer reads of an engine's block cache (radix.py's RadixCache)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def public_blocks(self) -> int:
        """Blocks a summary announces: `num_blocks` less private (salted) ones."""
        ...
    @property
    def capacity_blocks(self) -> int: ...
    def cached_hashes(self) -> Iterable[int]: ...
    def root_hashes(self) -> list[int]: ...
    def match_hashes(self, chain: Sequence[int]) -> int: ...
    def drain_events(self) -> list[CacheEvent]: ...
    def statistics(self) -> Mapping[str, int]: ...


class EngineView(Protocol):
    """An engine as gossip, lookup, probing and the views see it: its cache and load."""

    @property
    def model_id(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hasher(self) -> BlockHasher: ...
    @property
    def cache(self) -> CacheView: ...
    def load(self) -> EngineLoad: ...

    def local_match_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest cached prefix of `token_ids` (whole blocks, exact)."""
        ...

    def generating(self) -> GeneratingEngine | None:
        """This engine as one that generates, or None (a cache-only engine)."""
        ...


class GeneratingEngine(EngineView, Protocol):
    """An engine that generates: what serving, the pipeline and the inference service use
    (peer.engine.engine.Engine implements it)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def max_context(self) -> int: ...

    @property
    def queue_wait_observers(self) -> list[Callable[[float], None]]:
        """Called with each request's wait before its first step (metrics: queue wait)."""
        ...

    @property
    def verify(self) -> Verify | None:
        """The teacher-forced check of another peer's output; None: this engine cannot."""
        ...

    def encode_prompt(self, prompt: str | Sequence[dict[str, str]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]: ...

    def statistics(self) -> Mapping[str, int | float]: ...

    def stream(
        self, token_ids: Sequence[int], params: SamplingParams, *, cache_salt: bytes | None = ...,
        background: bool = ...,
    ) -> AsyncGenerator[TokenEvent | Completion, None]: ...

    async def refresh_speeds(self) -> None:
        """Forever: keep the advertised speeds measured (run it in the peer's nursery)."""
        ...
