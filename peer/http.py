"""The OpenAI-compatible HTTP API of one peer, served Trio-natively (hypercorn + Starlette).

    await peer.start_service(serve_http, peer, "127.0.0.1", 0)   # -> "http://127.0.0.1:PORT"

Endpoints: POST /v1/completions and /v1/chat/completions (JSON or server-sent events),
GET /v1/models, /v1/swarm (this peer's view of the swarm), /health, /metrics (Prometheus),
and the peer's page: / (see peer/web), with /v1/requests (recent requests and counters).
Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}.
Every response that ran a request names the peer that served it: the
`x-prefixswarm-served-by` header and an `x_prefixswarm` object (served_by, entry peer,
route). A client that disconnects cancels its request everywhere along the route.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from peer.admission import Overloaded
from peer.engine.api import InvalidRequest, SamplingParams
from peer.metrics import CONTENT_TYPE, Metrics
from peer.openai_schema import (
    MAX_BODY_BYTES,
    ApiError,
    parse_body,
    parse_cache_salt,
    parse_params,
    parse_prompt,
    usage,
)
from peer.pipeline import DeadlineExceeded, GenerationChunk, GenerationResult, RequestFailed
from peer.version import version
from peer.web.routes import PAGE_PATHS, Page

SERVED_BY_HEADER = "x-prefixswarm-served-by"
ENTRY_HEADER = "x-prefixswarm-entry"
CLIENT_CLOSED = 499  # status recorded (never sent) when the client went away mid-request
# Bursts of new connections beyond the accept queue get resets: 300 at once overflowed
# hypercorn's default of 100; 1024 gave none (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 1024
OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})  # answered without the API key: liveness
# probes, and the page itself (it asks for the key and sends it on every call it makes)
MAX_API_KEY_CHARS = 1024  # a bound on what is compared; real keys are ~50 characters

logger = logging.getLogger(__name__)


def _internal_error(exc: BaseException) -> ApiError:
    return ApiError(
        500, f"internal error ({type(exc).__name__}); it was logged and counted",
        type="server_error", code="internal_error",
    )


def error_for(exc: BaseException) -> ApiError:
    """The HTTP answer to a domain error raised by Peer.stream()."""
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


_REQUEST_ERRORS = (ApiError, InvalidRequest, Overloaded, RequestFailed)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, at most MAX_BODY_BYTES; ApiError otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large")
    return parse_body(bytes(data))


# -- the generation response -------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One parsed generation request."""

    endpoint: str
    chat: bool
    stream: bool
    include_usage: bool
    model: str
    token_ids: list[int]
    params: SamplingParams
    request_id: str
    cache_salt: bytes | None = None  # a private request: see docs/operations.md


def _sse(obj: Any) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class GenerationResponse:
    """An ASGI response that runs the request, JSON or server-sent events.

    Nothing is sent before the first token (or the error), so errors before it get their
    own status code; a client disconnect cancels the request (its engine step included).
    """

    def __init__(self, api: HttpApi, job: _Job) -> None:
        self._api = api
        self._job = job
        self._created = int(time.time())  # the OpenAI "created" field: wall clock by contract
        self.status = 200
        self._started = False  # http.response.start was sent
        self._complete = False  # the last body part is being sent or was sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
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
                logger.exception("request %s failed unexpectedly", self._job.request_id)
                self._api.metrics.record_unexpected(self._job.endpoint, exc)
                await self._send_unexpected(send, exc)
            finally:
                nursery.cancel_scope.cancel()
        self._api.metrics.record_request(self._job.endpoint, self.status)

    async def _send_unexpected(self, send: Any, exc: BaseException) -> None:
        error = _internal_error(exc)
        if not self._started:
            self._job = replace(self._job, stream=False)  # one JSON error body
            headers = {"content-type": "application/json"}
            await self._start(send, 500, headers, json.dumps(error.body()).encode())
        elif not self._complete:  # a stream whose headers are out: an error event ends it
            self._complete = True
            body = _sse(error.body()) + _sse("[DONE]")
            await send({"type": "http.response.body", "body": body, "more_body": False})
            self.status = 500

    async def _start(self, send: Any, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": raw})
        self._complete = not self._job.stream
        await send({"type": "http.response.body", "body": body, "more_body": self._job.stream})

    async def _send_error(self, send: Any, exc: BaseException) -> None:
        error = error_for(exc)
        if isinstance(exc, RequestFailed):
            self._api.metrics.record_route(exc.attempts)
        headers = {"content-type": "application/json", **error.headers}
        await self._start(send, error.status, headers, json.dumps(error.body()).encode())

    async def _respond(self, send: Any) -> None:
        job, api = self._job, self._api
        extra = {} if job.cache_salt is None else {"cache_salt": job.cache_salt}
        agen = _timed(
            api.peer.stream(job.token_ids, job.params, request_id=job.request_id, **extra),
            api.metrics,
        )
        async with aclosing(agen):
            try:
                first = await agen.__anext__()
            except _REQUEST_ERRORS as exc:
                if job.stream:
                    job = self._job = replace(job, stream=False)  # one JSON error body
                await self._send_error(send, exc)
                return
            served_by = getattr(first, "served_by", "")
            headers = {ENTRY_HEADER: api.peer.peer_id, SERVED_BY_HEADER: served_by}
            if not job.stream:
                items = [first]
                try:
                    items += [item async for item in agen]
                except _REQUEST_ERRORS as exc:
                    await self._send_error(send, exc)
                    return
                result = items[-1]
                assert isinstance(result, GenerationResult)
                api.metrics.record_result(result, api.peer.peer_id)
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
                        api.metrics.record_result(item, api.peer.peer_id)
                        await self._body(send, self._last(item))
                        break
                    item = await agen.__anext__()
            except _REQUEST_ERRORS as exc:  # after the headers: an error event ends the stream
                await self._body(send, _sse(error_for(exc).body()))
            self._complete = True
            await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})

    @staticmethod
    async def _body(send: Any, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    # -- OpenAI objects ------------------------------------------------------------------

    def _head(self, chunk: bool) -> dict[str, Any]:
        job = self._job
        kind = "chat.completion" if job.chat else "text_completion"
        return {
            "id": ("chatcmpl-" if job.chat else "cmpl-") + job.request_id,
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
            "entry_peer": self._api.peer.peer_id,
            "ttft_s": round(result.ttft_s, 6),
            "total_s": round(result.total_s, 6),
            "route": [
                {
                    "peer_id": a.peer_id, "local": a.is_local, "outcome": a.outcome.value,
                    "detail": a.detail, "tokens": a.tokens,
                }
                for a in result.route
            ],
        }


async def _timed(agen: Any, metrics: Metrics) -> AsyncGenerator[Any, None]:
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


# -- the application -----------------------------------------------------------------


class HttpApi:
    """The Starlette application of one peer (`.app`), with its metrics."""

    def __init__(
        self, peer: Any, *, model_alias: str | None = None, api_key: str | None = None
    ) -> None:
        if api_key is not None and not 1 <= len(api_key) <= MAX_API_KEY_CHARS:
            raise ValueError(f"the API key must have 1 to {MAX_API_KEY_CHARS} characters")
        self.peer = peer
        self._api_key = None if api_key is None else f"Bearer {api_key}".encode()
        self.model_id: str = peer.engine.model_id
        alias = model_alias if model_alias is not None else peer.config.model
        served = getattr(peer.config, "served_model_names", ())
        self.model_names = tuple(dict.fromkeys([self.model_id, alias, *served]))
        self.metrics = Metrics(peer.statistics)
        self.page = Page(self)
        observers = getattr(peer.engine, "queue_wait_observers", None)
        if observers is not None:  # engines without it (cache-only fakes) have no queue
            observers.append(self.metrics.queue_wait.observe)
        completions = self._endpoint("completions", chat=False)
        chat = self._endpoint("chat", chat=True)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/swarm", self.swarm, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                *self.page.routes,
            ],
            exception_handlers={HTTPException: _http_error, Exception: self._unexpected},
        )
        self.app.add_middleware(_CheckKey, api=self)

    def authorized(self, scope: Any) -> bool:
        """Whether a request may pass: no key configured, an open path, or the right key."""
        if self._api_key is None or scope.get("path") in OPEN_PATHS:
            return True
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(given[: MAX_API_KEY_CHARS + 16], self._api_key)

    async def _unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        """A bug in a handler: a JSON 500, logged and counted in /metrics."""
        logger.exception("%s %s failed unexpectedly", request.method, request.url.path)
        endpoint = request.url.path.rsplit("/", 1)[-1] or "root"
        self.metrics.record_unexpected(endpoint, exc)
        self.metrics.record_request(endpoint, 500)
        error = _internal_error(exc)
        return JSONResponse(error.body(), status_code=500, headers=error.headers)

    def _endpoint(self, name: str, *, chat: bool) -> Callable[[Request], Awaitable[Any]]:
        async def endpoint(request: Request) -> Any:
            try:
                return GenerationResponse(self, await self._job(name, request, chat))
            except _REQUEST_ERRORS as exc:
                error = error_for(exc)
            except Exception as exc:  # a bug (e.g. in the tokenizer): a counted JSON 500
                logger.exception("parsing a %s request failed unexpectedly", name)
                self.metrics.record_unexpected(name, exc)
                error = _internal_error(exc)
            self.metrics.record_request(name, error.status)
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

        return endpoint

    async def _job(self, name: str, request: Request, chat: bool) -> _Job:
        body = await read_json(request)
        model = body.get("model") or self.model_id
        if model not in self.model_names:
            raise ApiError(
                404,  # as OpenAI answers an unknown model
                f"model {model!r} is not served here; this swarm serves "
                + " or ".join(repr(m) for m in self.model_names),
                param="model",
                code="model_not_found",
            )
        params = parse_params(body, chat)
        prompt = parse_prompt(body, chat)
        cache_salt = parse_cache_salt(body)
        serving = self.peer.serving
        if serving is None:
            raise ApiError(503, "this peer has no model loaded", type="server_error")
        token_ids = serving.encode(prompt)
        context = self.peer.engine.max_context
        if len(token_ids) + params.max_new_tokens > context:
            raise ApiError(
                400,
                f"this model's context is {context} tokens; the prompt has {len(token_ids)} and "
                f"max_tokens is {params.max_new_tokens}: shorten the prompt or lower max_tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        options = body.get("stream_options") or {}
        return _Job(
            endpoint=name,
            chat=chat,
            stream=bool(body.get("stream")),
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            model=str(model),
            token_ids=token_ids,
            params=params,
            request_id=uuid.uuid4().hex,
            cache_salt=cache_salt,
        )

    async def models(self, request: Request) -> JSONResponse:
        self.metrics.record_request("models", 200)
        context = self.peer.engine.max_context
        data = [
            {
                "id": name, "object": "model", "created": 0, "owned_by": "prefixswarm",
                "root": self.model_id, "max_model_len": context, "context_length": context,
            }
            for name in self.model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def version(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": version()})

    async def health(self, request: Request) -> JSONResponse:
        stats = self.peer.statistics()
        return JSONResponse(
            {
                "status": "ok",
                "peer_id": self.peer.peer_id,
                "model": self.model_id,
                "peers_known": stats["peers_known"],
                "can_generate": self.peer.serving is not None,
            }
        )

    async def swarm(self, request: Request) -> JSONResponse:
        self.metrics.record_request("swarm", 200)
        return JSONResponse(swarm_view(self.peer))

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def trust_view(trust: Any, peer_id: str) -> dict[str, Any] | None:
    """What this peer's trust ledger holds about ``peer_id`` (None without a ledger)."""
    if trust is None:
        return None
    t = trust.view(peer_id)
    return {
        "state": t.state.value,
        "reason": t.reason,
        "verified": t.verified,
        "served": t.served,
        "discount": round(t.discount, 4),
        "claims": t.claims.value,
    }


async def _http_error(request: Request, exc: Any) -> JSONResponse:
    """Unknown routes and methods as OpenAI error objects (Starlette's are plain text)."""
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions"
    else:
        message = f"{request.method} {request.url.path}: {exc.detail}"
    error = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


class _CheckKey:
    """ASGI middleware: without the right `Authorization: Bearer KEY`, a 401 error object."""

    def __init__(self, app: Any, api: HttpApi) -> None:
        self._app = app
        self._api = api

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self._api.authorized(scope):
            await self._app(scope, receive, send)
            return
        self._api.metrics.record_request("unauthorized", 401)
        error = ApiError(
            401, "a valid API key is required: send 'Authorization: Bearer KEY'",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
        response = JSONResponse(error.body(), status_code=401, headers=error.headers)
        await response(scope, receive, send)


def swarm_view(peer: Any) -> dict[str, Any]:
    """This peer's view of the swarm, as plain JSON: itself, then every peer in its table."""
    now = trio.current_time()
    engine = peer.engine
    load = engine.load()
    cache = engine.cache
    peers = []
    trust = peer.serving.trust if getattr(peer, "serving", None) is not None else None
    for view in peer.table.views(now):
        s = view.summary
        peers.append(
            {
                "peer_id": view.peer_id,
                "addrs": list(view.addrs),
                "rtt_s": view.rtt_s,
                "summary_age_s": round(view.age_s, 3),
                "summary_seq": s.seq,
                "cached_blocks": s.cached_blocks,
                "capacity_blocks": s.capacity_blocks,
                "queued_prompt_tokens": s.queued_prompt_tokens,
                "running_requests": s.running_requests,
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "decode_tokens_per_s": s.decode_tokens_per_s,
                "forwards_since_summary": view.forwards_since_summary,
                "trust": trust_view(trust, view.peer_id),
                "link": peer.link_to(view.peer_id) if hasattr(peer, "link_to") else None,
                "link_remote": (
                    peer.link_remote(view.peer_id) if hasattr(peer, "link_remote") else None
                ),
            }
        )
    return {
        "self": {
            "peer_id": peer.peer_id,
            "addrs": list(peer.multiaddrs),
            "model": engine.model_id,
            "block_size": engine.block_size,
            "cached_blocks": cache.num_blocks,
            "capacity_blocks": cache.capacity_blocks,
            "queued_prompt_tokens": load.queued_prompt_tokens,
            "running_requests": load.running_requests,
            "prefill_tokens_per_s": load.prefill_tokens_per_s,
            "decode_tokens_per_s": load.decode_tokens_per_s,
            "policy": peer.config.policy.value,
            "reachability": getattr(peer, "reachability", "unknown"),
            "holepunch": (
                peer.host.holepunch.statistics()
                if getattr(getattr(peer, "host", None), "holepunch", None) is not None
                else None
            ),
        },
        "peers": sorted(peers, key=lambda p: p["peer_id"]),
    }


def hypercorn_config(host: str, port: int) -> HypercornConfig:
    """How hypercorn serves the API: bind, quiet logs, backlog, shutdown grace."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.backlog = LISTEN_BACKLOG
    config.graceful_timeout = 1.0  # in-flight requests get this long when the peer stops
    return config


async def serve_http(
    peer: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_alias: str | None = None,
    api_key: str | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the peer's HTTP API until cancelled; reports the bound URL (port 0 works).

    With `api_key`, every path but /health needs `Authorization: Bearer <api_key>`."""
    config = hypercorn_config(host, port)
    api = HttpApi(peer, model_alias=model_alias, api_key=api_key)

    async def serve(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await hypercorn_serve(api.app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve)
        nursery.start_soon(api.page.sample_forever)
        task_status.started(binds[0])
