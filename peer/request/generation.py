"""The generation service: what a face (HTTP, CLI, an embedding program) asks of a peer.

A request goes one way: the face calls `GenerationService.prepare` once (tokenise, check
every limit, the context window included, in one place) and gets a `GenerationRequest`;
`GenerationService.run` streams `GenerationChunk`s and ends with one `GenerationResult`
or raises one of the errors below. Nothing downstream validates the request again, and
the sampling parameters stay `SamplingParams` until a forward puts them on the wire
(peer/request/forward.py) or a forwarded request takes them off it (peer/request/inference.py).

Plain types and a Protocol: no trio, libp2p or torch (a pure module, mypy --strict).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from peer.engine.api import SamplingParams

__all__ = [
    "Attempt",
    "DeadlineExceeded",
    "GenerationChunk",
    "GenerationItem",
    "GenerationRequest",
    "GenerationResult",
    "GenerationService",
    "Outcome",
    "Prompt",
    "RequestFailed",
]

# Text, chat messages (rendered with the model's chat template) or token ids as given.
Prompt = str | Sequence[dict[str, str]] | Sequence[int]


class Outcome(enum.Enum):
    OK = "ok"
    REFUSED = "refused"  # the peer answered with a retryable error (e.g. overloaded)
    FAILED = "failed"  # unreachable, broken stream, protocol error
    STALLED = "stalled"  # no first token / no next token in time
    HANDED_OVER = "handed_over"  # failed after streaming tokens; the next one continues
    WRONG_OUTPUT = "wrong_output"  # verification rejected it: the peer is quarantined


@dataclass(frozen=True)
class Attempt:
    peer_id: str
    is_local: bool
    outcome: Outcome
    detail: str
    tokens: int  # tokens this attempt contributed
    reason: str = ""  # the router's account of why it was a candidate (Candidate.reason)
    waited_s: float = 0.0  # what it cost the client: the time it was waited on in vain
    charged: float = 0.0  # what the trust ledger charged it, in failures (reliability.py)


class RequestFailed(Exception):
    """No candidate completed the request; `attempts` says what happened with each."""

    def __init__(self, message: str, attempts: Sequence[Attempt]) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


class DeadlineExceeded(RequestFailed):
    """The request's end-to-end deadline passed."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: made by `GenerationService.prepare`, never by hand.

    `cache_salt` makes it private (served on this peer only, over blocks of the same
    salt); `timeout_s` replaces the peer's end-to-end request timeout."""

    request_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: bytes | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class GenerationChunk:
    """Tokens produced since the last chunk and their text."""

    token_ids: tuple[int, ...]
    text: str
    served_by: str


@dataclass(frozen=True)
class GenerationResult:
    """A finished request, whichever peer(s) served it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # reused by the peer that computed the prompt's first token
    completion_tokens: int
    ttft_s: float  # at the entry peer, from admission to the first token
    total_s: float
    served_by: str  # the peer that produced the last token
    route: tuple[Attempt, ...]


GenerationItem = GenerationChunk | GenerationResult


class GenerationService(Protocol):
    """The one way in for generation (peer/request/serving.py's `Serving` implements it)."""

    @property
    def max_context(self) -> int:
        """Prompt plus generated tokens that fit the model."""
        ...

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: bytes | None = None,
        timeout_s: float | None = None,
    ) -> GenerationRequest:
        """The request, checked once; InvalidRequest (ContextTooLong for the context
        window) naming the broken limit otherwise."""
        ...

    def run(self, request: GenerationRequest) -> AsyncGenerator[GenerationItem, None]:
        """Chunks as tokens arrive, then one GenerationResult; raises Overloaded,
        DeadlineExceeded or RequestFailed. Close it (aclosing) when done."""
        ...
