"""Happy eyeballs for one request: candidates race for the first token, with hedging.

`Race.run` starts the first candidate; if it has no first token after its hedge delay (a
multiple of the router's TTFT estimate, with a floor), the next starts too, at most
MAX_RACING at once; a failure starts the next at once. The first racer with a token wins
and the others are cancelled (reset); one that started before the winner was hedged and
lost, and shows as stalled in the route (it is not backed off: see HedgeLost). Each
remote racer's first-token deadline is a multiple of its estimate, with a floor, capped
by ``forward_first_token_s``.

Failures are reported through ``on_failed`` the moment they happen; `cancel_waiters`
lets the pipeline move every request waiting on a failed peer's first token along.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from peer.config import PeerConfig
from peer.engine.api import SamplingParams
from peer.request.forward import AttemptFailed, HedgeLost, LocalAttempt, MovedOn, RemoteAttempt
from peer.request.generation import Attempt
from peer.routing.router import Candidate
from peer.routing.trust import TrustLedger

MAX_RACING = 3  # attempts racing for one request's first token at once (hedging bound)
# The time left that a forward must at least have: below it, running locally is better.
MIN_FORWARD_BUDGET_S = 0.05

AnyAttempt = LocalAttempt | RemoteAttempt


# Builds one candidate's attempt (Pipeline._attempt), AttemptFailed if it cannot, from
# the candidate, the prompt, its params, the request id, the deadline and the cache salt.
MakeAttempt = Callable[
    [Candidate, list[int], SamplingParams, str, float, bytes | None], AnyAttempt
]
# A failed attempt, recorded by the pipeline the moment it happens (route: the request's).
OnFailed = Callable[[Candidate, AttemptFailed, list[Attempt]], None]


@dataclass
class Racer:
    """One candidate racing for the first token."""

    candidate: Candidate
    attempt: AnyAttempt
    index: int  # start order within the race
    verify: bool = False  # the trust ledger chose its response for verification
    failed: bool = False  # failed on its own (not merely cancelled because another won)


def estimated_ttft_s(candidate: Candidate) -> float:
    """The router's estimate of a candidate's time to first token."""
    cost = candidate.cost
    return cost.network_s + cost.queue_s + cost.prefill_s


class Race:
    """Runs races for a pipeline; remembers who waits on which peer's first token."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        trust: TrustLedger,
        rng: random.Random,
        stats: Counter[str],
        make_attempt: MakeAttempt,
        on_failed: OnFailed,
    ) -> None:
        self._config = config
        self._trust = trust
        self._rng = rng
        self._stats = stats
        self._make_attempt = make_attempt
        self._on_failed = on_failed
        # Racers waiting on a peer's first token, by peer: cancelled when it fails.
        self._waiting: dict[str, set[trio.CancelScope]] = {}

    def first_token_timeout_s(self, candidate: Candidate) -> float:
        """A forward's first-token deadline: a multiple of the router's estimate, floored,
        capped by forward_first_token_s."""
        config = self._config
        estimate = estimated_ttft_s(candidate)
        timeout = max(config.first_token_floor_s, config.first_token_multiple * estimate)
        return min(timeout, config.forward_first_token_s)

    def hedge_delay_s(self, candidate: Candidate) -> float:
        """How long a candidate races alone before the next one starts (inf: never)."""
        config = self._config
        if candidate.is_local or config.hedge_multiple <= 0:
            return math.inf  # this peer's own estimate is exact; hedging it doubles work
        return max(config.hedge_floor_s, config.hedge_multiple * estimated_ttft_s(candidate))

    def cancel_waiters(self, peer_id: str) -> None:
        """Every racer waiting on ``peer_id``'s first token gives up on it now."""
        for waiter in self._waiting.pop(peer_id, ()):
            waiter.cancel()

    async def run(
        self,
        pending: deque[Candidate],
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        deadline: float,
        route: list[Attempt],
        *,
        cache_salt: bytes | None = None,
    ) -> Racer | None:
        """Start candidates from ``pending``, hedging, until one has a first token.
        ``cache_salt`` goes to ``make_attempt``."""
        winner: list[Racer] = []
        running: list[Racer] = []
        started: list[Racer] = []
        wake = [trio.Event()]  # set when a racer fails: the next one starts at once
        async with trio.open_nursery() as nursery:
            index = 0
            while pending and not winner:
                if len(running) >= MAX_RACING:
                    await wake[0].wait()
                    wake[0] = trio.Event()
                    continue
                candidate = pending.popleft()
                left = deadline - trio.current_time()
                if left <= 0:
                    pending.clear()
                    break
                if not candidate.is_local and left < MIN_FORWARD_BUDGET_S:
                    continue
                try:
                    attempt = self._make_attempt(
                        candidate, prompt, params, request_id, deadline, cache_salt
                    )
                except AttemptFailed as exc:
                    self._on_failed(candidate, exc, route)
                    continue
                racer = Racer(candidate, attempt, index)
                index += 1
                running.append(racer)
                started.append(racer)
                wake[0] = trio.Event()
                nursery.start_soon(
                    self._open, racer, deadline, winner, running, wake, nursery.cancel_scope, route
                )
                with trio.move_on_after(self.hedge_delay_s(candidate)):
                    await wake[0].wait()
                if not wake[0].is_set() and not winner and pending:
                    self._stats["hedges"] += 1
        if winner:
            # Racers cancelled because another won did not fail: should the winner fail
            # later (a wrong answer, a broken stream), they are tried again, in their
            # order; above all this peer itself, always the last resort.
            others = [r.candidate for r in started if r is not winner[0] and not r.failed]
            pending.extendleft(reversed(others))
        return winner[0] if winner else None

    async def _open(
        self,
        racer: Racer,
        deadline: float,
        winner: list[Racer],
        running: list[Racer],
        wake: list[trio.Event],
        race_scope: trio.CancelScope,
        route: list[Attempt],
    ) -> None:
        """Open one racer's attempt; the first with a token wins and ends the race."""
        candidate, attempt = racer.candidate, racer.attempt
        peer_id = candidate.peer_id
        timeout = math.inf if candidate.is_local else self.first_token_timeout_s(candidate)
        waiter = trio.CancelScope()
        if not candidate.is_local:
            self._waiting.setdefault(peer_id, set()).add(waiter)
        try:
            with trio.move_on_at(min(deadline, trio.current_time() + timeout)) as timer:
                with waiter:
                    await attempt.open()
            if waiter.cancelled_caught:
                raise MovedOn
            if timer.cancelled_caught:
                raise AttemptFailed("stalled", f"no first token in {timeout:.3f} s")
        except AttemptFailed as exc:
            racer.failed = True
            running.remove(racer)
            await attempt.aclose()
            self._on_failed(candidate, exc, route)
            wake[0].set()
            return
        except trio.Cancelled:  # another racer won
            running.remove(racer)
            with trio.CancelScope(shield=True):
                await attempt.aclose()
            if winner and racer.index < winner[0].index:
                self._on_failed(candidate, HedgeLost(), route)
            raise
        finally:
            self._stop_waiting(peer_id, waiter)
        running.remove(racer)
        if winner:  # another one won in the same instant
            await attempt.aclose()
            return
        racer.verify = not candidate.is_local and self._trust.should_verify(peer_id, self._rng)
        winner.append(racer)
        race_scope.cancel()

    def _stop_waiting(self, peer_id: str, waiter: trio.CancelScope) -> None:
        waiters = self._waiting.get(peer_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiting[peer_id]
