"""PeerThread: a peer for programs that are not Trio (asyncio, or plain threads).

    with PeerThread(PeerConfig(model="tiny-random")) as peer:         # blocking calls
        print(peer.generate("Hello", SamplingParams(max_new_tokens=8)).text)

    async with PeerThread(PeerConfig(model="tiny-random")) as peer:   # asyncio
        result = await peer.agenerate("Hello")
        async for item in peer.astream("Hello"):
            ...

The peer runs under `trio.run` in one thread that this object starts and joins: a
foreign event loop cannot host Trio tasks, and a thread serves blocking programs too.
Each call becomes a task in the peer's nursery; its answer comes back through a
concurrent.futures.Future, so cancelling the caller (an asyncio task, or leaving a
stream early) cancels that task. close() (or leaving the block) stops the peer, waits for
the thread, and re-raises what stopped the peer if it was an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, suppress
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import trio

from peer.config import PeerConfig as BaseConfig
from prefixswarm.embed import PeerConfig, open_peer

if TYPE_CHECKING:
    from peer.engine.api import EngineView, SamplingParams
    from peer.node import Peer
    from peer.request.generation import GenerationChunk, GenerationResult, Prompt

__all__ = ["CLOSE_TIMEOUT_S", "PeerClosed", "PeerThread"]

T = TypeVar("T")
# close() waits this long for the thread: cancelling the peer's nursery closes sockets
# and returns at once; a model step in a worker thread finishes first (seconds at most).
CLOSE_TIMEOUT_S = 30.0
_END = object()  # ends a stream's queue


class PeerClosed(RuntimeError):
    """The peer is not running (not started yet, stopped, or failed)."""


def _settle(future: concurrent.futures.Future[T], value: Any = None, *,
            error: BaseException | None = None) -> None:
    """Complete `future` unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by the caller: nobody waits for the answer


class PeerThread:
    """One peer in its own Trio thread, with blocking and asyncio methods."""

    def __init__(
        self, config: BaseConfig | None = None, *, engine: EngineView | None = None
    ) -> None:
        self.config = config if config is not None else PeerConfig()
        self._engine = engine
        self._thread: threading.Thread | None = None
        self._up = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._peer: Peer | None = None

    # -- lifetime ----------------------------------------------------------------------

    def start(self) -> PeerThread:
        """Start the peer and wait until it is up (loading the model: seconds to
        minutes); raises what kept it from starting (ConfigError for the settings)."""
        if self._thread is not None:
            raise RuntimeError("a PeerThread starts once")
        # daemon: a program that forgets close() still exits (the peer dies with it)
        self._thread = threading.Thread(target=self._run, name="prefixswarm-peer", daemon=True)
        self._thread.start()
        self._up.wait()  # set when the peer is up and when the thread ends, whichever first
        if self._peer is None:
            self._thread.join()
            error, self._error = self._error, None  # raised here, not again by close()
            raise error or PeerClosed("the peer stopped while starting")
        return self

    def close(self) -> None:
        """Stop the peer and wait for its thread; re-raise the error that ended it."""
        thread = self._thread
        if thread is None:
            return
        if thread is threading.current_thread():
            raise RuntimeError("close() from the peer's own thread would wait for itself")
        if self._token is not None and self._stop is not None:
            with suppress(trio.RunFinishedError):  # it stopped already
                self._token.run_sync_soon(self._stop.set)
        thread.join(CLOSE_TIMEOUT_S)
        if thread.is_alive():
            raise TimeoutError(f"the peer did not stop within {CLOSE_TIMEOUT_S:g} s")
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # handed to start() or close(), never lost
            self._error = exc
        finally:
            self._peer = self._nursery = None
            self._up.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with (
            open_peer(self.config, engine=self._engine) as peer,
            trio.open_nursery() as nursery,
        ):
            self._peer, self._nursery = peer, nursery
            self._up.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()  # calls still running end with PeerClosed

    def __enter__(self) -> PeerThread:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> PeerThread:
        """start() in a worker thread; if the awaiting task is cancelled meanwhile, the
        peer is closed as soon as it is up, so no peer outlives an abandoned start."""
        lock, state = threading.Lock(), {"abandoned": False, "started": False}

        def start_unless_abandoned() -> PeerThread:
            self.start()
            with lock:
                state["started"] = not state["abandoned"]
            if not state["started"]:
                self.close()
            return self

        try:
            return await asyncio.to_thread(start_unless_abandoned)
        except asyncio.CancelledError:
            with lock:
                state["abandoned"] = True
                started = state["started"]
            if started:  # it was up before the cancellation arrived: close it in a thread
                asyncio.get_running_loop().run_in_executor(None, self.close)
            raise

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.close)

    # -- calls into the peer -------------------------------------------------------------

    def submit(self, fn: Callable[[Peer], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run `await fn(peer)` as a task in the peer's thread; cancelling the returned
        future cancels the task. The future fails with PeerClosed if the peer stops."""
        token, nursery = self._token, self._nursery
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if token is None or nursery is None or self._peer is None:
            raise PeerClosed("the peer is not running (start() it, or use `with`)")
        peer, scope = self._peer, trio.CancelScope()

        async def task() -> None:
            try:
                with scope:
                    try:
                        value = await fn(peer)
                    except Exception as exc:  # the caller's to handle, through the future
                        _settle(future, error=exc)
                    else:
                        _settle(future, value)
            finally:
                if not future.done():
                    _settle(future, error=PeerClosed("the peer stopped during the call"))

        def spawn() -> None:  # in the Trio thread, outside any task: must not raise
            try:
                nursery.start_soon(task)
            except RuntimeError:  # the nursery closed: the peer is stopping
                _settle(future, error=PeerClosed("the peer is stopping"))

        def on_done(done: concurrent.futures.Future[T]) -> None:
            if done.cancelled():
                with suppress(trio.RunFinishedError):  # the peer stopped: nothing to cancel
                    token.run_sync_soon(scope.cancel)

        future.add_done_callback(on_done)
        try:
            token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise PeerClosed("the peer has stopped") from None
        return future

    def _sync(self, fn: Callable[[Peer], T]) -> T:
        """`fn(peer)` in the peer's thread (a quick read of its state)."""
        peer, token = self._peer, self._token
        if peer is None or token is None:
            raise PeerClosed("the peer is not running")
        try:
            return trio.from_thread.run_sync(fn, peer, trio_token=token)
        except trio.RunFinishedError:
            raise PeerClosed("the peer has stopped") from None

    @property
    def peer_id(self) -> str:
        return self._sync(lambda peer: peer.peer_id)

    @property
    def multiaddrs(self) -> list[str]:
        """Dialable addresses, each ending in /p2p/<peer id>."""
        return self._sync(lambda peer: peer.multiaddrs)

    def statistics(self) -> dict[str, Any]:
        return self._sync(lambda peer: peer.statistics())

    # -- blocking -------------------------------------------------------------------------

    def call(self, fn: Callable[[Peer], Awaitable[T]]) -> T:
        """`await fn(peer)` in the peer's thread, e.g. starting its HTTP API:
        `url = pt.call(lambda p: p.start_service(serve_http, p, "127.0.0.1", 0))`."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking call from the peer's own thread would wait for itself")
        future = self.submit(fn)
        try:
            return future.result()
        finally:
            future.cancel()  # a no-op once done; an interrupt (Ctrl-C) cancels the task

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 **options: Any) -> GenerationResult:
        """Peer.generate: complete `prompt` on the best peer (blocks until done)."""
        return self.call(lambda peer: peer.generate(prompt, params, **options))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               **options: Any) -> Iterator[GenerationChunk | GenerationResult]:
        """Peer.stream: chunks, then the result; leaving the loop early cancels it."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking call from the peer's own thread would wait for itself")
        items: queue.SimpleQueue[object] = queue.SimpleQueue()
        future = self.submit(functools.partial(_pump, prompt, params, options, items.put))
        future.add_done_callback(lambda _: items.put(_END))
        try:
            while (item := items.get()) is not _END:
                yield cast("GenerationChunk | GenerationResult", item)
            future.result()  # the request's error, if it failed
        finally:
            future.cancel()

    # -- asyncio ---------------------------------------------------------------------------

    async def acall(self, fn: Callable[[Peer], Awaitable[T]]) -> T:
        """call() for asyncio: cancelling the awaiting task cancels the call."""
        return await asyncio.wrap_future(self.submit(fn))

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None,
                        **options: Any) -> GenerationResult:
        """generate() for asyncio."""
        return await self.acall(lambda peer: peer.generate(prompt, params, **options))

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None,
                      **options: Any) -> AsyncIterator[GenerationChunk | GenerationResult]:
        """stream() for asyncio; leaving the loop early (or cancelling) cancels it."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[object] = asyncio.Queue()  # at most the request's tokens + 2

        def put(item: object) -> None:  # from the peer's thread
            loop.call_soon_threadsafe(items.put_nowait, item)

        future = self.submit(functools.partial(_pump, prompt, params, options, put))
        future.add_done_callback(lambda _: put(_END))
        try:
            while (item := await items.get()) is not _END:
                yield cast("GenerationChunk | GenerationResult", item)
            future.result()
        finally:
            future.cancel()


async def _pump(prompt: Prompt, params: SamplingParams | None, options: dict[str, Any],
                put: Callable[[object], None], peer: Peer) -> None:
    """Peer.stream's items, each handed to `put` (thread-safe) as it arrives."""
    async with aclosing(peer.stream(prompt, params, **options)) as items:
        async for item in items:
            put(item)
