"""All of a process's torch work runs on one thread (peer/engine/compute_thread.py): a
second thread running OpenMP work makes every step pay futex wake-ups."""

from __future__ import annotations

import threading

import pytest
import trio

from peer.engine.compute_thread import ComputeThread, compute_thread
from peer.engine.engine import SamplingParams
from peer.engine.runner import Runner


@pytest.fixture
def worker():
    thread = ComputeThread("test-compute")
    yield thread
    thread.close()


async def test_every_job_runs_on_the_one_thread_from_trio_and_from_plain_code(worker) -> None:
    seen = {await worker.run(threading.get_ident) for _ in range(5)}
    seen |= {await trio.to_thread.run_sync(worker.call, threading.get_ident) for _ in range(5)}
    assert seen == {worker.ident} and worker.ident != threading.get_ident()


async def test_results_and_exceptions_reach_the_caller(worker) -> None:
    assert await worker.run(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        await worker.run(divmod, 1, 0)
    with pytest.raises(KeyError):
        await trio.to_thread.run_sync(worker.call, {}.__getitem__, "missing")
    assert await worker.run(len, "still serving") == 13


async def test_jobs_run_one_at_a_time_in_the_order_submitted(worker) -> None:
    order: list[int] = []
    release = threading.Event()

    async def submit(i: int) -> None:
        await worker.run(lambda: (release.wait(5), order.append(i)))

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(submit, i)
            await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert order == [0, 1, 2, 3]


async def test_a_cancelled_caller_gets_its_jobs_result_then_the_cancel(worker) -> None:
    release = threading.Event()
    done: list[str] = []
    scope = trio.CancelScope()

    def job() -> str:
        release.wait(5)
        done.append("job")
        return "result"

    async def caller() -> None:
        with scope:
            done.append(await worker.run(job))
            await trio.lowlevel.checkpoint()  # the cancel arrives here

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        await trio.sleep(0.05)  # the job is running
        scope.cancel()
        await trio.sleep(0.05)
        assert done == []  # the caller still waits: torch work is not abandoned
        release.set()
    assert scope.cancelled_caught and done == ["job", "result"]
    assert await worker.run(len, "next") == 4  # and the thread goes on serving


def test_a_job_that_calls_the_thread_again_runs_inline(worker) -> None:
    assert worker.call(lambda: worker.call(threading.get_ident)) == worker.ident


async def test_an_engines_forwards_run_on_the_process_compute_thread(
    tiny_engine, monkeypatch
) -> None:
    threads: set[int] = set()
    forward = Runner.forward

    def recording(self, *args, **kwargs):
        threads.add(threading.get_ident())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "forward", recording)
    done = await tiny_engine.generate([5, 6, 7, 8] * 10, SamplingParams(max_new_tokens=4))
    assert len(done.token_ids) == 4
    assert threads == {compute_thread().ident}
