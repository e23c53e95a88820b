"""Happy eyeballs for one request: candidates race for the first token, with hedging.

`Race.run` starts the first candidate; if it has no first token after its hedge delay (a
multiple of the router's TTFT estimate, with a floor), the next starts too, at most
MAX_RACING at once; a failure starts the next at once. The first racer with a token wins
and the others are cancelled (reset); one that started before the winner was hedged and
lost: it shows as stalled in the route with the time it cost, and the trust ledger
charges it a fraction of a failure (peer/routing/reliability.py; the router's back-off
does not apply: see HedgeLost). Each
remote racer's first-token deadline is a multiple of its estimate, with a floor, capped
by ``forward_first_token_s``.

A race is one object per try of a request (peer/request/run.py builds it with its
attempt factory bound to the request); `Waiters`, shared by the pipeline's races, lets a
peer's failure move every request waiting on its first token along.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from peer.config import PeerConfig
from peer.request.forward import AttemptFailed, HedgeLost, LocalAttempt, MovedOn, RemoteAttempt
from peer.request.generation import Outcome
from peer.routing.router import Candidate
from peer.routing.trust import TrustLedger

MAX_RACING = 3  # attempts racing for one request's first token at once (hedging bound)
# A forward's silence between tokens is a stall after this many of its tokens' expected
# time (the router's decode estimate, itself bounded by what was observed), at least
# TOKEN_GAP_FLOOR_S (a busy engine's step with a long prefill chunk, or a GC pause, takes
# tenths of a second, and an honest tiny-model peer on a 2-core machine at load 15 was
# seen silent for over 2 s), at most PeerConfig.forward_token_gap_s.
TOKEN_GAP_MULTIPLE = 20.0
TOKEN_GAP_FLOOR_S = 5.0
# The time left that a forward must at least have: below it, running locally is better.
MIN_FORWARD_BUDGET_S = 0.05

AnyAttempt = LocalAttempt | RemoteAttempt

# One candidate's attempt, for a request already bound (AttemptFailed if it cannot be made).
MakeAttempt = Callable[[Candidate], AnyAttempt]
# A failed attempt, recorded the moment it happens, with the seconds it was waited on.
OnFailed = Callable[[Candidate, AttemptFailed, float], None]


@dataclass
class Racer:
    """One candidate racing for the first token."""

    candidate: Candidate
    attempt: AnyAttempt
    index: int  # start order within the race
    verify: bool = False  # the trust ledger chose its response for verification
    failed: bool = False  # failed on its own (not merely cancelled because another won)
    started_at: float = 0.0  # when its attempt started (the shell's clock)


def estimated_ttft_s(candidate: Candidate) -> float:
    """The router's estimate of a candidate's time to first token."""
    cost = candidate.cost
    return cost.network_s + cost.queue_s + cost.prefill_s


def first_token_timeout_s(config: PeerConfig, candidate: Candidate) -> float:
    """A forward's first-token deadline, counted from its request sent (RemoteAttempt.open):
    a multiple of the router's estimate, floored, capped by forward_first_token_s."""
    estimate = estimated_ttft_s(candidate)
    timeout = max(config.first_token_floor_s, config.first_token_multiple * estimate)
    return min(timeout, config.forward_first_token_s)


def token_gap_s(config: PeerConfig, candidate: Candidate) -> float:
    """How long a forward's stream may be silent between two tokens before it is stalled."""
    decode = candidate.estimate.decode_tokens_per_s
    expected = TOKEN_GAP_MULTIPLE / decode if decode > 0 else math.inf
    return min(config.forward_token_gap_s, max(TOKEN_GAP_FLOOR_S, expected))


def hedge_delay_s(config: PeerConfig, candidate: Candidate) -> float:
    """How long a candidate races alone before the next one starts (inf: never)."""
    if candidate.is_local or config.hedge_multiple <= 0:
        return math.inf  # this peer's own estimate is exact; hedging it doubles work
    return max(config.hedge_floor_s, config.hedge_multiple * estimated_ttft_s(candidate))


class Waiters:
    """Who waits on which peer's first token, across a pipeline's races."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[trio.CancelScope]] = {}

    def add(self, peer_id: str, waiter: trio.CancelScope) -> None:
        self._waiting.setdefault(peer_id, set()).add(waiter)

    def discard(self, peer_id: str, waiter: trio.CancelScope) -> None:
        waiters = self._waiting.get(peer_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiting[peer_id]

    def cancel(self, peer_id: str) -> None:
        """Every racer waiting on ``peer_id``'s first token gives up on it now."""
        for waiter in self._waiting.pop(peer_id, ()):
            waiter.cancel()


class Race:
    """One race for a request's first token, over the candidates it is given."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        trust: TrustLedger,
        rng: random.Random,
        stats: Counter[str],
        waiters: Waiters,
        make_attempt: MakeAttempt,
        on_failed: OnFailed,
        deadline: float,
    ) -> None:
        self._config = config
        self._trust = trust
        self._rng = rng
        self._stats = stats
        self._waiters = waiters
        self._make_attempt = make_attempt
        self._on_failed = on_failed
        self._deadline = deadline
        self._winner: Racer | None = None
        self._running: list[Racer] = []
        self._started: list[Racer] = []
        self._wake = trio.Event()  # set when a racer fails: the next one starts at once

    async def run(self, pending: deque[Candidate]) -> Racer | None:
        """Start candidates from ``pending``, hedging, until one has a first token."""
        async with trio.open_nursery() as nursery:
            while pending and self._winner is None:
                if len(self._running) >= MAX_RACING:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                candidate = pending.popleft()
                left = self._deadline - trio.current_time()
                if left <= 0:
                    pending.clear()
                    break
                if not candidate.is_local and left < MIN_FORWARD_BUDGET_S:
                    continue
                try:
                    attempt = self._make_attempt(candidate)
                except AttemptFailed as exc:
                    self._on_failed(candidate, exc, 0.0)
                    continue
                racer = Racer(
                    candidate, attempt, len(self._started), started_at=trio.current_time()
                )
                self._running.append(racer)
                self._started.append(racer)
                self._wake = trio.Event()
                nursery.start_soon(self._open, racer, nursery.cancel_scope)
                with trio.move_on_after(hedge_delay_s(self._config, candidate)):
                    await self._wake.wait()
                if not self._wake.is_set() and self._winner is None and pending:
                    self._stats["hedges"] += 1
        winner = self._winner
        if winner is not None:
            # Racers cancelled because another won did not fail: should the winner fail
            # later (a wrong answer, a broken stream), they are tried again, in their
            # order; above all this peer itself, always the last resort.
            others = [r.candidate for r in self._started if r is not winner and not r.failed]
            pending.extendleft(reversed(others))
        return winner

    async def _open(self, racer: Racer, race_scope: trio.CancelScope) -> None:
        """Open one racer's attempt; the first with a token wins and ends the race."""
        candidate, attempt = racer.candidate, racer.attempt
        peer_id = candidate.peer_id
        timeout = (
            math.inf if candidate.is_local else first_token_timeout_s(self._config, candidate)
        )
        waiter = trio.CancelScope()
        if not candidate.is_local:
            self._waiters.add(peer_id, waiter)
        try:
            with trio.move_on_at(self._deadline) as timer:
                with waiter:
                    await attempt.open(timeout)  # STALLED past `timeout` after its request
            if waiter.cancelled_caught:
                raise MovedOn
            if timer.cancelled_caught:
                raise AttemptFailed(Outcome.STALLED, "no first token before the deadline")
        except AttemptFailed as exc:
            racer.failed = True
            self._running.remove(racer)
            await attempt.aclose()
            self._on_failed(candidate, exc, trio.current_time() - racer.started_at)
            self._wake.set()
            return
        except trio.Cancelled:  # another racer won
            self._running.remove(racer)
            with trio.CancelScope(shield=True):
                await attempt.aclose()
            if self._winner is not None and racer.index < self._winner.index:
                self._on_failed(candidate, HedgeLost(), trio.current_time() - racer.started_at)
            raise
        finally:
            self._waiters.discard(peer_id, waiter)
        self._running.remove(racer)
        if self._winner is not None:  # another one won in the same instant
            await attempt.aclose()
            return
        racer.verify = not candidate.is_local and self._trust.should_verify(peer_id, self._rng)
        self._winner = racer
        race_scope.cancel()
