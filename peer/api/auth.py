"""The HTTP API's optional API key: an ASGI middleware that answers 401 without it.

With a key configured, every path but OPEN_PATHS needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from peer.api.openai_schema import ApiError
from peer.api.web.routes import PAGE_PATHS

OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})  # answered without the API key: liveness
# probes, and the page itself (it asks for the key and sends it on every call it makes)
MAX_API_KEY_CHARS = 1024  # a bound on what is compared; real keys are ~50 characters


class ApiKey:
    """Who may pass: no key configured, an open path, or the right key."""

    def __init__(self, api_key: str | None) -> None:
        if api_key is not None and not 1 <= len(api_key) <= MAX_API_KEY_CHARS:
            raise ValueError(f"the API key must have 1 to {MAX_API_KEY_CHARS} characters")
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()

    def authorized(self, scope: Scope) -> bool:
        if self._expected is None or scope.get("path") in OPEN_PATHS:
            return True
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(given[: MAX_API_KEY_CHARS + 16], self._expected)


class CheckKey:
    """ASGI middleware: without the right `Authorization: Bearer KEY`, a 401 error object
    (``on_refused`` counts it)."""

    def __init__(self, app: ASGIApp, key: ApiKey, on_refused: Callable[[], None]) -> None:
        self._app = app
        self._key = key
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._key.authorized(scope):
            await self._app(scope, receive, send)
            return
        self._on_refused()
        error = ApiError(
            401, "a valid API key is required: send 'Authorization: Bearer KEY'",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
        response = JSONResponse(error.body(), status_code=401, headers=error.headers)
        await response(scope, receive, send)
