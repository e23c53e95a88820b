"""Which tokens the next batched step computes, and the batch state machine it plans over
(pure; the simulator may import it).

A step runs every decoding sequence's next token and, with the tokens left in the step's
budget, prefill chunks of the sequences still reading their prompts, oldest first. Decodes
go first so that a long prompt arriving never stalls the streams already running for more
than one step's worth of prefill (the budget bounds that step), and a prompt longer than
the budget is read over several steps (chunked prefill) while decodes continue between.
BatchQueue holds who waits and who is in the batch; batch.py's BatchLoop drives it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = [
    "BACKGROUND_SHARE",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_STEP_TOKENS",
    "BatchQueue",
    "Scheduled",
    "StepPlan",
    "admit_count",
    "plan_step",
    "reusable_blocks",
    "reusable_tokens",
    "waits_for_shared_prefill",
]

# ~0.5 s of SmolLM2 prefill on 2 CPU cores: the most a running stream waits for a new prompt.
DEFAULT_STEP_TOKENS = 256
# Sequences in the batch at once; more wait (admission happens between steps).
DEFAULT_MAX_RUNNING = 32
# Prompts read for other peers get at most 1/4 of a step's tokens, and only in steps that
# read none of ours: a step of ours then waits at most ~1/4 of a full step for theirs.
BACKGROUND_SHARE = 4


@dataclass(frozen=True)
class StepPlan:
    """One step: ids decoding one token each, and (id, tokens) prefill chunks in order."""

    decode: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


def plan_step(
    decoding: Sequence[int], prefilling: Sequence[tuple[int, int]], token_budget: int
) -> StepPlan:
    """The next step for sequences `decoding` (ids) and `prefilling` ((id, prompt tokens
    left), oldest first) within `token_budget` tokens. Every decode is in the step even
    past the budget (a stream never waits for a prompt), and the oldest prefill gets at
    least one token so that prompts always advance."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    left = max(token_budget - len(decoding), 1 if prefilling else 0)
    chunks: list[tuple[int, int]] = []
    for rid, remaining in prefilling:
        if left <= 0:
            break
        if remaining < 1:
            raise ValueError(f"sequence {rid} has {remaining} prompt tokens left")
        n = min(remaining, left)
        chunks.append((rid, n))
        left -= n
    return StepPlan(tuple(decoding), tuple(chunks))


def admit_count(waiting: int, running: int, max_running: int) -> int:
    """How many waiting requests join the batch before the next step."""
    return max(0, min(waiting, max_running - running))


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The most whole blocks of a prompt its cache can supply: at least one prompt token is
    always computed, since its logits give the first generated token."""
    return (prompt_tokens - 1) // block_size if prompt_tokens > 0 else 0


def reusable_tokens(cached_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """Of `cached_tokens` matched in the cache, how many a request reuses (reusable_blocks)."""
    return min(cached_tokens, reusable_blocks(prompt_tokens, block_size) * block_size)


def waits_for_shared_prefill(
    tokens: Sequence[int], reusable: int, block_size: int, prefilling: Iterable[Sequence[int]]
) -> bool:
    """Whether a waiting prompt `tokens`, of which the cache can supply `reusable` tokens,
    is held back this step: it shares at least one more block than that with one of the
    `prefilling` prompts (admitted, still being read). That prompt's blocks are inserted
    when it is read, and this one then reuses them instead of computing them a second time
    (requests that share a prefix often arrive together)."""
    want = reusable + block_size
    if want > reusable_blocks(len(tokens), block_size) * block_size:
        return False
    head = tokens[:want]
    return any(other[:want] == head for other in prefilling)


class Scheduled(Protocol):
    """A sequence as the batch sees it: an id, its prompt, and how much of it is read."""

    @property
    def rid(self) -> int: ...
    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def pos(self) -> int: ...


S = TypeVar("S", bound=Scheduled)


class BatchQueue(Generic[S]):
    """The batch state machine: sequences wait, join the batch between steps (`admit`),
    are planned a step at a time (`plan`), and leave it finished or cancelled.

    `rank(seq)` orders who goes first, lower first and oldest first within a rank: the
    peer ranks its own clients' requests 0 and requests served for other peers 1, so
    those join the batch and read their prompts only after its own (decodes all run)."""

    def __init__(self, rank: Callable[[S], int] | None = None) -> None:
        self.waiting: deque[S] = deque()
        self.batch: dict[int, S] = {}  # admitted, unfinished; insertion order = age
        self._rank = rank
        self._held_back = False  # the last step left the others' decodes out

    def submit(self, seq: S) -> None:
        self.waiting.append(seq)

    def admit(
        self, max_running: int, join: Callable[[S], None],
        hold: Callable[[S], bool] | None = None,
    ) -> None:
        """Move waiting sequences into the batch, oldest first, while it has fewer than
        `max_running`. `join(seq)` runs just before a sequence enters (the caller matches
        its prompt then), so `hold` sees it for the later ones; `hold(seq)` True keeps a
        sequence waiting for the next step."""
        free = admit_count(len(self.waiting), len(self.batch), max_running)
        kept: deque[S] = deque()
        order = self.waiting if self._rank is None else sorted(self.waiting, key=self._rank)
        self.waiting = deque()
        for seq in order:
            if free <= 0 or (hold is not None and hold(seq)):
                kept.append(seq)
                continue
            free -= 1
            join(seq)
            self.batch[seq.rid] = seq
        self.waiting = kept if self._rank is None else deque(sorted(kept, key=_age))

    def finish(self, rid: int) -> None:
        """The sequence leaves the batch (it ended or failed); no-op if it is not in it."""
        self.batch.pop(rid, None)

    def leave(self, seq: S) -> None:
        """The sequence is released, wherever it is (a cancelled one leaves at the next step)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.batch.pop(seq.rid, None)

    def plan(self, step_tokens: int) -> StepPlan:
        """The next step over the batch: every decode, then prefill chunks oldest first.

        With a rank, prompts ranked above 0 (served for others) are read only in steps
        where no rank-0 prompt is read, and then at most step_tokens // BACKGROUND_SHARE
        tokens of them: a step's time grows with its tokens, so a long remote prompt
        neither shares our prompts' steps nor makes the step one of ours waits for long.
        A step that reads one of our prompts decodes only our streams, unless the step
        before it held the others back too: their decodes (long contexts, up to the remote
        slots) lengthen the step our first token waits for, and they lose at most every
        other step while our prompts are read, never their place."""
        decoding = [s for s in self.batch.values() if s.pos >= len(s.tokens)]
        reading = [s for s in self.batch.values() if s.pos < len(s.tokens)]
        budget = step_tokens
        if self._rank is not None:
            rank = self._rank
            ours = [s for s in reading if rank(s) <= 0]
            if ours:
                reading = ours
                mine = [s for s in decoding if rank(s) <= 0]
                if self._held_back or len(mine) == len(decoding):
                    self._held_back = False
                else:
                    decoding, self._held_back = mine, True
            else:
                self._held_back = False
                reading.sort(key=rank)  # stable: oldest first within a rank
                budget = len(decoding) + max(1, step_tokens // BACKGROUND_SHARE)
        prefilling = [(s.rid, len(s.tokens) - s.pos) for s in reading]
        return plan_step([s.rid for s in decoding], prefilling, budget)


def _age(seq: Scheduled) -> int:
    """Submission order: ids are given out in order (batch.py's _next_rid)."""
    return seq.rid
