"""The one thread that runs a process's torch work.

torch's CPU kernels run their parallel loops on OpenMP (libgomp, on Linux). libgomp gives
every thread that starts parallel work a team of its own, and once it manages more threads
than the machine has CPUs, a team's workers stop spinning between parallel regions and
sleep on a futex instead, so each region pays a wake-up. A decode step runs a few hundred
regions. Measured on a 2-core machine (SmolLM2 int4, the compiled step at 700 tokens):
6.3 ms a step from the only thread that ever ran torch, 7.7 ms from any second one, and
every thread slowed while two that had run it were alive (32,000 context switches a
second against 14; `python -m bench.compute_thread`). Trio's worker threads are pooled,
not pinned, so the engine's steps landed on whichever one was free, beside the thread that
had loaded the model.

So an engine's torch work (loading, steps, verification, warm-up, cache copies) goes
through `run` (from Trio) or `call` (from plain code) on this one thread, created on
first use and kept for the life of the process (a daemon thread: it holds no resource
that outlives the process). Jobs run one at a time, in order of submission.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

__all__ = ["ComputeThread", "compute_thread"]

T = TypeVar("T")
_Job = tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], None]]


class ComputeThread:
    """A thread that runs submitted callables one after another."""

    def __init__(self, name: str = "prefixswarm-compute") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, deliver = job
            deliver(outcome.capture(fn))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on this thread; its result or exception. As with
        trio.to_thread.run_sync, a cancellation waits for `fn` (torch work cannot be
        interrupted): its result is returned and the cancel comes at the next checkpoint."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if threading.current_thread() is self._thread:
            raise RuntimeError("ComputeThread.run called from its own thread")
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def deliver(result: outcome.Outcome[Any]) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the caller's run has ended
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._jobs.put((functools.partial(fn, *args), deliver))

        def abort(_: Any) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED  # wait for fn, as to_thread does

        result: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on this thread, blocking the calling thread until it returns."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        done: queue.SimpleQueue[outcome.Outcome[Any]] = queue.SimpleQueue()
        self._jobs.put((functools.partial(fn, *args), done.put))
        result: T = done.get().unwrap()
        return result

    def close(self) -> None:
        """Stop after the jobs already submitted (the process-wide one is never closed)."""
        self._jobs.put(None)
        self._thread.join()


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """The process's compute thread, started on first use."""
    global _shared
    if _shared is None:  # every step asks: no lock once it exists
        with _shared_lock:
            if _shared is None:
                _shared = ComputeThread()
    return _shared
