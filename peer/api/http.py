"""The OpenAI-compatible HTTP API of one peer, served Trio-natively (hypercorn + Starlette).

    await peer.start_service(serve_http, peer, "127.0.0.1", 0)   # -> "http://127.0.0.1:PORT"

Endpoints: POST /v1/completions and /v1/chat/completions (JSON or server-sent events),
GET /v1/models, /v1/swarm (this peer's view of the swarm), /health, /metrics (Prometheus),
and the peer's page: / (see peer/api/web), with /v1/requests (recent requests and counters).
Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}.
Every response that ran a request names the peer that served it: the
`x-prefixswarm-served-by` header and an `x_prefixswarm` object (served_by, entry peer,
route). A client that disconnects cancels its request everywhere along the route.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from peer.api.auth import (
    MAX_API_KEY_CHARS,
    OPEN_PATHS,
    AllowedHosts,
    ApiKey,
    BrowserGuard,
    CheckKey,
    multiaddr_names,
)
from peer.api.face import FacePeer
from peer.api.metrics import CONTENT_TYPE, Metrics
from peer.api.openai_schema import (
    MAX_BODY_BYTES,
    ApiError,
    parse_body,
    parse_cache_salt,
    parse_params,
    parse_prompt,
)
from peer.api.responses import (
    CLIENT_CLOSED,
    ENTRY_HEADER,
    REQUEST_ERRORS,
    SERVED_BY_HEADER,
    GenerationResponse,
    Job,
    error_for,
    internal_error,
)
from peer.api.web.routes import Page
from peer.engine.api import ContextTooLong
from peer.request.generation import GenerationService
from peer.version import version

__all__ = [  # names tests and embedders import from here
    "CLIENT_CLOSED",
    "ENTRY_HEADER",
    "LISTEN_BACKLOG",
    "MAX_API_KEY_CHARS",
    "MAX_BODY_BYTES",
    "OPEN_PATHS",
    "SERVED_BY_HEADER",
    "HttpApi",
    "error_for",
    "hypercorn_config",
    "read_json",
    "serve_http",
]

# Bursts of new connections beyond the accept queue get resets: 300 at once overflowed
# hypercorn's default of 100; 1024 gave none (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 1024

if TYPE_CHECKING:  # trio's TaskStatus, as the trio-stubs py-libp2p pulls in type it
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)


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


# -- the application -----------------------------------------------------------------


class HttpApi:
    """The Starlette application of one peer (`.app`), with its metrics.

    It generates only through the peer's GenerationService (`peer.request.generation`)."""

    def __init__(
        self, peer: FacePeer, *, model_alias: str | None = None, api_key: str | None = None,
        allowed_hosts: AllowedHosts | None = None,
    ) -> None:
        """`allowed_hosts`: the Host names it answers to (BrowserGuard); None: any (an
        app served by something other than serve_http, which knows its own names)."""
        key = ApiKey(api_key)
        self.peer = peer
        self.model_id = peer.model_id
        config = peer.config
        alias = model_alias if model_alias is not None else config.model
        self.model_names = tuple(  # the name it was started with first, then the full id
            dict.fromkeys([alias, self.model_id, *config.served_model_names])
        )
        self.metrics = Metrics(peer.statistics)
        self.page = Page(peer, self.metrics)
        peer.observe_queue_wait(self.metrics.queue_wait.observe)
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
        self.app.add_middleware(
            CheckKey, key=key,
            on_refused=lambda: self.metrics.record_request("unauthorized", 401),
        )
        self.app.add_middleware(  # added last: it runs first
            BrowserGuard, hosts=allowed_hosts,
            on_refused=lambda code, status: self.metrics.record_request(code, status),
        )

    async def _unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        """A bug in a handler: a JSON 500, logged and counted in /metrics."""
        logger.exception("%s %s failed unexpectedly", request.method, request.url.path)
        endpoint = request.url.path.rsplit("/", 1)[-1] or "root"
        self.metrics.record_unexpected(endpoint, exc)
        self.metrics.record_request(endpoint, 500)
        error = internal_error(exc)
        return JSONResponse(error.body(), status_code=500, headers=error.headers)

    def _endpoint(self, name: str, *, chat: bool) -> Callable[[Request], Awaitable[ASGIApp]]:
        async def endpoint(request: Request) -> ASGIApp:
            try:
                service, job = await self._job(name, request, chat)
            except REQUEST_ERRORS as exc:
                error = error_for(exc)
            except Exception as exc:  # a bug (e.g. in the tokenizer): a counted JSON 500
                logger.exception("parsing a %s request failed unexpectedly", name)
                self.metrics.record_unexpected(name, exc)
                error = internal_error(exc)
            else:
                return GenerationResponse(service, self.metrics, self.peer.peer_id, job)
            self.metrics.record_request(name, error.status)
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

        return endpoint

    async def _job(
        self, name: str, request: Request, chat: bool
    ) -> tuple[GenerationService, Job]:
        """The service that runs the request, and the request prepared by it."""
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
        service = self.peer.generation
        if service is None:
            raise ApiError(503, "this peer has no model loaded", type="server_error")
        try:
            prepared = service.prepare(prompt, params, cache_salt=cache_salt)
        except ContextTooLong as exc:
            raise ApiError(
                400,
                f"this model's context is {exc.context} tokens; the prompt has "
                f"{exc.prompt_tokens} and max_tokens is {exc.max_new_tokens}: shorten the "
                "prompt or lower max_tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            ) from None
        options = body.get("stream_options") or {}
        return service, Job(
            endpoint=name,
            chat=chat,
            stream=bool(body.get("stream")),
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            model=str(model),
            request=prepared,
        )

    async def models(self, request: Request) -> JSONResponse:
        self.metrics.record_request("models", 200)
        context = self.peer.max_context
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
                "can_generate": self.peer.generation is not None,
            }
        )

    async def swarm(self, request: Request) -> JSONResponse:
        self.metrics.record_request("swarm", 200)
        return JSONResponse(self.peer.swarm_view())

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Unknown routes and methods as OpenAI error objects (Starlette's are plain text)."""
    if not isinstance(exc, HTTPException):  # registered for HTTPException only
        raise TypeError(f"not an HTTPException: {exc!r}")
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions"
    else:
        message = f"{request.method} {request.url.path}: {exc.detail}"
    error = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


# How long an idle connection stays open. Clients keep theirs for 5 s (httpx's default,
# and so the OpenAI SDK's); a server that closed at the same 5 s (hypercorn's default)
# raced a client sending its next request on a connection being closed, and the client
# got "Server disconnected without sending a response" (2 of 30,000 testbed requests).
KEEP_ALIVE_S = 15.0


def hypercorn_config(host: str, port: int, grace_s: float = 1.0) -> HypercornConfig:
    """How hypercorn serves the API: bind, quiet logs, backlog, idle connections, shutdown
    grace."""
    config = HypercornConfig()
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.backlog = LISTEN_BACKLOG
    config.graceful_timeout = grace_s  # what in-flight requests get once serving stops
    return config


async def serve_http(
    peer: FacePeer,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_alias: str | None = None,
    api_key: str | None = None,
    drain: trio.Event | None = None,
    drain_timeout_s: float = 1.0,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the peer's HTTP API until cancelled; reports the bound URL (port 0 works).

    With `api_key`, every path but /health needs `Authorization: Bearer <api_key>`. Once
    `drain` is set the API stops accepting connections and gives the requests in flight
    up to `drain_timeout_s` to finish, then returns."""
    config = hypercorn_config(host, port, drain_timeout_s)
    config_addrs = (*peer.config.listen_addrs, *peer.config.announce_addrs)
    names = [*multiaddr_names(config_addrs), socket.gethostname()]  # no DNS lookup here
    api = HttpApi(peer, model_alias=model_alias, api_key=api_key,
                  allowed_hosts=AllowedHosts(host, names))
    trigger = drain.wait if drain is not None else None

    async with trio.open_nursery() as nursery:

        async def serve(*, task_status: TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            await hypercorn_serve(
                api.app, config, shutdown_trigger=trigger,  # type: ignore[arg-type]
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # drained: the page's sampling stops too

        binds: list[str] = await nursery.start(serve)
        nursery.start_soon(api.page.sample_forever)
        task_status.started(binds[0])
