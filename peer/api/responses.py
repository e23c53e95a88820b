"""One generation request over HTTP: the parsed job, and the ASGI response that runs it
through the peer's GenerationService (JSON or server-sent events), with the OpenAI objects
it answers with and the error objects of the domain errors."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import trio
from starlette.types import Receive, Scope, Send

from peer.api.metrics import Metrics
from peer.api.openai_schema import ApiError, usage
from peer.engine.api import InvalidRequest
from peer.request.admission import Overloaded
from peer.request.generation import (
    DeadlineExceeded,
    GenerationChunk,
    GenerationItem,
    GenerationRequest,
    GenerationResult,
    GenerationService,
    RequestFailed,
)

SERVED_BY_HEADER = "x-prefixswarm-served-by"
ENTRY_HEADER = "x-prefixswarm-entry"
CLIENT_CLOSED = 499  # status recorded (never sent) when the client went away mid-request

logger = logging.getLogger(__name__)


def internal_error(exc: BaseException) -> ApiError:
    return ApiError(
        500, f"internal error ({type(exc).__name__}); it was logged and counted",
        type="server_error", code="internal_error",
    )


def error_for(exc: BaseException) -> ApiError:
    """The HTTP answer to a domain error of GenerationService.prepare() or .run()."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, Overloaded):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        headers = {"Retry-After": retry}
        return ApiError(429, str(exc), type="overloaded_error", code="overloaded", headers=headers)
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, str(exc), type="timeout_error", code="deadline_exceeded")
    if isinstance(exc, RequestFailed):
        return ApiError(503, str(exc), type="server_error", code="no_peer_available")
    raise TypeError(f"not a request error: {exc!r}")


REQUEST_ERRORS = (ApiError, InvalidRequest, Overloaded, RequestFailed)


@dataclass(frozen=True)
class Job:
    """One parsed generation request: how to answer it, and the request itself."""

    endpoint: str
    chat: bool
    stream: bool
    include_usage: bool
    model: str
    request: GenerationRequest  # validated by the GenerationService (prepare)


def _sse(obj: Any) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class GenerationResponse:
    """An ASGI response that runs the request, JSON or server-sent events.

    Nothing is sent before the first token (or the error), so errors before it get their
    own status code; a client disconnect cancels the request (its engine step included).
    """

    def __init__(
        self, service: GenerationService, metrics: Metrics, entry_id: str, job: Job
    ) -> None:
        self._service = service
        self._metrics = metrics
        self._entry_id = entry_id  # this peer's id, for the headers and x_prefixswarm
        self._job = job
        self._created = int(time.time())  # the OpenAI "created" field: wall clock by contract
        self.status = 200
        self._started = False  # http.response.start was sent
        self._complete = False  # the last body part is being sent or was sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with trio.open_nursery() as nursery:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not self._complete:  # (hypercorn also says so after a complete response)
                    self.status = CLIENT_CLOSED
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch_disconnect)
            try:
                await self._respond(send)
            except Exception as exc:  # a bug: answer a 500 (or end the stream), count it
                logger.exception("request %s failed unexpectedly", self._job.request.request_id)
                self._metrics.record_unexpected(self._job.endpoint, exc)
                await self._send_unexpected(send, exc)
            finally:
                nursery.cancel_scope.cancel()
        self._metrics.record_request(self._job.endpoint, self.status)

    async def _send_unexpected(self, send: Send, exc: BaseException) -> None:
        error = internal_error(exc)
        if not self._started:
            self._job = replace(self._job, stream=False)  # one JSON error body
            headers = {"content-type": "application/json"}
            await self._start(send, 500, headers, json.dumps(error.body()).encode())
        elif not self._complete:  # a stream whose headers are out: an error event ends it
            self._complete = True
            body = _sse(error.body()) + _sse("[DONE]")
            await send({"type": "http.response.body", "body": body, "more_body": False})
            self.status = 500

    async def _start(self, send: Send, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": raw})
        self._complete = not self._job.stream
        await send({"type": "http.response.body", "body": body, "more_body": self._job.stream})

    async def _send_error(self, send: Send, exc: BaseException) -> None:
        error = error_for(exc)
        if isinstance(exc, RequestFailed):
            self._metrics.record_route(exc.attempts)
        headers = {"content-type": "application/json", **error.headers}
        await self._start(send, error.status, headers, json.dumps(error.body()).encode())

    async def _respond(self, send: Send) -> None:
        job, metrics = self._job, self._metrics
        agen = _timed(self._service.run(job.request), metrics)
        async with aclosing(agen):
            try:
                first = await agen.__anext__()
            except REQUEST_ERRORS as exc:
                if job.stream:
                    job = self._job = replace(job, stream=False)  # one JSON error body
                await self._send_error(send, exc)
                return
            served_by = getattr(first, "served_by", "")
            headers = {ENTRY_HEADER: self._entry_id, SERVED_BY_HEADER: served_by}
            if not job.stream:
                items = [first]
                try:
                    items += [item async for item in agen]
                except REQUEST_ERRORS as exc:
                    await self._send_error(send, exc)
                    return
                result = items[-1]
                assert isinstance(result, GenerationResult)
                metrics.record_result(result, self._entry_id)
                headers[SERVED_BY_HEADER] = result.served_by
                headers["content-type"] = "application/json"
                await self._start(send, 200, headers, json.dumps(self._full(result)).encode())
                return
            headers.update({"content-type": "text/event-stream", "cache-control": "no-cache"})
            opening = self._delta(None, role=True) if job.chat else b""
            await self._start(send, 200, headers, opening)
            item: GenerationChunk | GenerationResult = first
            try:
                while True:
                    if isinstance(item, GenerationChunk):
                        if item.text:
                            await self._body(send, self._delta(item.text))
                    else:
                        metrics.record_result(item, self._entry_id)
                        await self._body(send, self._last(item))
                        break
                    item = await agen.__anext__()
            except REQUEST_ERRORS as exc:  # after the headers: an error event ends the stream
                await self._body(send, _sse(error_for(exc).body()))
            self._complete = True
            await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})

    @staticmethod
    async def _body(send: Send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    # -- OpenAI objects ------------------------------------------------------------------

    def _head(self, chunk: bool) -> dict[str, Any]:
        job = self._job
        kind = "chat.completion" if job.chat else "text_completion"
        return {
            "id": ("chatcmpl-" if job.chat else "cmpl-") + job.request.request_id,
            "object": kind + ".chunk" if chunk and job.chat else kind,
            "created": self._created,
            "model": job.model,
        }

    def _delta(self, text: str | None, role: bool = False) -> bytes:
        if self._job.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": None}
        return _sse({**self._head(chunk=True), "choices": [choice]})

    def _last(self, result: GenerationResult) -> bytes:
        head = self._head(chunk=True)
        finish = result.finish_reason
        if self._job.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        out = _sse({**head, "choices": [choice], "x_prefixswarm": self._extension(result)})
        if self._job.include_usage:
            out += _sse({**head, "choices": [], "usage": _usage(result)})
        return out

    def _full(self, result: GenerationResult) -> dict[str, Any]:
        if self._job.chat:
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "finish_reason": result.finish_reason}
        else:
            choice = {
                "index": 0, "text": result.text, "logprobs": None,
                "finish_reason": result.finish_reason,
            }
        return {
            **self._head(chunk=False),
            "choices": [choice],
            "usage": _usage(result),
            "x_prefixswarm": self._extension(result),
        }

    def _extension(self, result: GenerationResult) -> dict[str, Any]:
        return {
            "served_by": result.served_by,
            "entry_peer": self._entry_id,
            "ttft_s": round(result.ttft_s, 6),
            "total_s": round(result.total_s, 6),
            "route": [
                {
                    "peer_id": a.peer_id, "local": a.is_local, "outcome": a.outcome.value,
                    "detail": a.detail, "tokens": a.tokens,
                    "waited_s": round(a.waited_s, 6), "charged": round(a.charged, 4),
                }
                for a in result.route
            ],
        }


async def _timed(
    agen: AsyncGenerator[GenerationItem, None], metrics: Metrics
) -> AsyncGenerator[GenerationItem, None]:
    """`agen`'s items, recording the gaps between token chunks as inter-token latency."""
    last: float | None = None
    async with aclosing(agen):
        async for item in agen:
            if isinstance(item, GenerationChunk) and item.token_ids:
                now = trio.current_time()
                if last is not None:
                    metrics.record_token_gap(now - last, len(item.token_ids))
                last = now
            yield item


def _usage(result: GenerationResult) -> dict[str, Any]:
    return usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens)
