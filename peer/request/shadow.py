"""Shadows: copies of requests that check a peer on probation (the shell of
peer/routing/shadow.py).

When the planner chooses a shadow for a request, `Shadows.start` sends the same request
to the probation peer as an ordinary forward (the same protocol, message and deadline,
a fresh request id) in a task of the serving peer's nursery, reads the whole answer, and
waits for the answer the client received (`ShadowJob.deliver`). Only equal answers count
towards trust; a different one is checked by this peer's verifier where it has one: one
it accepts (a near-tie on other hardware, or a wrong delivered answer) earns nothing and
costs nothing; one it rejects, or any difference without a verifier, quarantines. The
client never waits for a shadow and never sees its tokens; a shadow's failure only backs
its peer off. A request that ends without an answer (`ShadowJob.abandon`) cancels its
shadow. An equal answer earns credit only if no peer asked says the probation peer asked
it for the same prompt (protocols/served.py): an answer obtained elsewhere earns nothing,
and its peer is backed off as after a failed shadow.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from peer.engine.api import EngineError, SamplingParams
from peer.request.forward import AttemptFailed, Faulty, Finished, RemoteAttempt
from peer.request.generation import Outcome
from peer.request.run_context import RunContext
from peer.routing.router import Candidate
from peer.routing.shadow import Shadow, ShadowPlanner, first_difference

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

# A forward to a candidate: candidate, prompt, params, request id, deadline.
RemoteFactory = Callable[[Candidate, list[int], SamplingParams, str, float], RemoteAttempt]


class ShadowJob:
    """One request's side of its shadow: the answer the client received, or none."""

    def __init__(self) -> None:
        self.delivered: tuple[int, ...] | None = None
        self.scope = trio.CancelScope()  # the shadow's; cancelled when there is no answer
        self._ended = trio.Event()

    def deliver(self, token_ids: Sequence[int]) -> None:
        """The client's answer (call before handing it to the client)."""
        if not self._ended.is_set():
            self.delivered = tuple(token_ids)
            self._ended.set()

    def abandon(self) -> None:
        """The request ended without an answer (or already delivered: nothing happens)."""
        if not self._ended.is_set():
            self._ended.set()
            self.scope.cancel()

    async def wait(self) -> tuple[int, ...] | None:
        await self._ended.wait()
        return self.delivered


class Shadows:
    """Sends, reads and judges the shadows the planner chooses; owns their tasks."""

    def __init__(
        self,
        *,
        planner: ShadowPlanner,
        context: RunContext,
        make_attempt: RemoteFactory,
        rng: random.Random,
    ) -> None:
        self.planner = planner
        self._context = context
        self._make_attempt = make_attempt
        self._rng = rng
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the shadows' tasks until cancelled (none start before or after)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def start(
        self,
        probation: Sequence[Candidate],
        prompt: list[int],
        params: SamplingParams,
        *,
        private: bool,
        deadline: float,
    ) -> ShadowJob | None:
        """A shadow of this request if the planner chooses one (and shadows are served)."""
        if self._nursery is None or not probation:
            return None
        shadow = self.planner.choose(probation, temperature=params.temperature,
                                     private=private, seed=params.seed)
        if shadow is None:
            return None
        candidate = next(c for c in probation if c.peer_id == shadow.peer_id)
        job = ShadowJob()
        self._nursery.start_soon(self._run, shadow, candidate, job, prompt, params, deadline)
        return job

    async def _run(
        self, shadow: Shadow, candidate: Candidate, job: ShadowJob, prompt: list[int],
        params: SamplingParams, deadline: float,
    ) -> None:
        planner, peer_id = self.planner, shadow.peer_id
        judged = False
        failure: AttemptFailed | None = None
        try:
            with job.scope:
                request_id = uuid.UUID(int=self._rng.getrandbits(128), version=4).hex
                try:
                    attempt = self._make_attempt(candidate, prompt, params, request_id,
                                                 deadline)
                except AttemptFailed as exc:
                    failure = exc
                    return
                try:
                    output = await self._read(attempt, deadline)
                except AttemptFailed as exc:
                    failure = exc
                    return
                finally:
                    with trio.CancelScope(shield=True):
                        await attempt.aclose()
                delivered = await job.wait()
                if delivered is None:
                    return
                judged = await self._judge(shadow, candidate, attempt, prompt, params,
                                           delivered, output)
        finally:
            if failure is not None:
                self._failed(shadow, failure)
            elif not judged:
                planner.ended(shadow, failed=False)
            logger.debug("shadow %d to %s ended (judged: %s)", shadow.number, peer_id, judged)

    async def _read(self, attempt: RemoteAttempt, deadline: float) -> list[int]:
        """The whole answer, under the longest first-token deadline any forward gets
        (`forward_first_token_s`): nobody waits for a shadow, and a busy newcomer's answer
        is as good late as early; the in-flight bounds limit what a staller holds."""
        timeout = self._context.config.forward_first_token_s
        with trio.move_on_at(min(deadline, trio.current_time() + timeout)) as timer:
            await attempt.open()
        if timer.cancelled_caught:
            raise AttemptFailed(Outcome.STALLED, f"no first token in {timeout:.3f} s")
        output = list(attempt.first)
        while not isinstance(more := await attempt.next_tokens(), Finished):
            output.extend(more)
        return output

    async def _judge(
        self, shadow: Shadow, candidate: Candidate, attempt: RemoteAttempt, prompt: list[int],
        params: SamplingParams, delivered: tuple[int, ...], output: list[int],
    ) -> bool:
        """Compare and record; False when no verdict could be reached."""
        context, peer_id = self._context, shadow.peer_id
        bad = first_difference(delivered, output)
        if bad is not None and context.verify is not None:
            try:
                verdict = await context.verify(prompt, output, params)
            except (EngineError, ValueError, RuntimeError) as exc:
                context.stats["verification_errors"] += 1
                logger.info("could not verify a shadow answer of %s: %s", peer_id, exc)
                return False
            context.stats["shadows_verified_after_difference"] += 1
            if verdict.ok:  # a near-tie, or the delivered answer was wrong
                logger.warning("a shadow answer of %s differs from the delivered one at "
                               "token %d and verifies: no credit", peer_id, bad)
                self.planner.inconclusive(shadow)
                return True
        if bad is None and context.served_elsewhere is not None:
            source = await context.served_elsewhere(peer_id, prompt)
            if source is not None:  # it asked another peer for this prompt: laundering
                logger.warning("peer %s answered a probation request with an answer it "
                               "asked %s for: no credit, backed off", peer_id, source)
                self.planner.obtained_elsewhere(shadow)
                # backed off like a failed shadow: the next shadows go to other newcomers
                context.router.record_outcome(peer_id, False, trio.current_time())
                return True
        now = trio.current_time()
        if bad is None:
            context.router.record_outcome(peer_id, True, now)
            context.observe(peer_id, attempt, prompt, len(output), candidate.estimate)
            promoted = self.planner.matched(shadow)
            if promoted is not None:
                logger.info("peer %s passed probation (%d matching answers)", peer_id,
                            promoted.verified)
            return True
        action = self.planner.mismatched(
            shadow, f"differs from the delivered answer at token {bad}", now
        )
        if action is not None:
            context.quarantined(action)
            context.accuse(attempt)
        return True

    def _failed(self, shadow: Shadow, exc: AttemptFailed) -> None:
        context, peer_id = self._context, shadow.peer_id
        self.planner.ended(shadow, failed=True)
        context.stats[f"shadow_{exc.outcome.value}"] += 1
        context.router.record_outcome(peer_id, False, trio.current_time())
        if isinstance(exc, Faulty):
            context.quarantine(peer_id, str(exc))
        logger.info("shadow to %s: %s (%s)", peer_id, exc.outcome.value, exc)
