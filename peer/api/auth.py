"""Who may use the HTTP API: the optional API key, and a guard against web pages.

With a key configured, every path but OPEN_PATHS needs `Authorization: Bearer KEY`.
`BrowserGuard` stops a page on another site from using a peer through its visitor's
browser: a POST must be JSON (a cross-site form or `text/plain` POST cannot set that
content type without a CORS preflight, which this API never grants), and the Host must
be a name this API was bound or announced under (`AllowedHosts`): a DNS-rebound name,
the attacker's own, is refused.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from peer.api.openai_schema import ApiError
from peer.api.web.routes import PAGE_PATHS
from peer.settings import is_loopback_host

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


JSON_MEDIA_TYPE = b"application/json"


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


def _host_name(value: bytes) -> str:
    """The name of a Host header value: 'example.org:8000' -> 'example.org', '[::1]:80' ->
    '::1'."""
    text = value.decode("latin-1").strip()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AllowedHosts:
    """The Host names an API bound at `bind_host` answers to.

    Bound to loopback: loopback names only. Bound beyond it: loopback names, address
    literals (a browser sends one only when the page's own URL names this address, so
    no DNS rebinding can produce it), the bound name, and `names` (what the peer
    announces: DNS names of its multiaddrs, the machine's host name). Anything else is
    a name that resolves here only because someone made it so."""

    def __init__(self, bind_host: str, names: Iterable[str] = ()) -> None:
        self.loopback = is_loopback_host(bind_host)
        self._names = frozenset(
            n.strip("[]").lower().rstrip(".") for n in (bind_host, *names) if n
        )

    def allows(self, host_name: str) -> bool:
        name = host_name.strip("[]").lower().rstrip(".")
        if is_loopback_host(name):
            return True
        if self.loopback:
            return False
        return _is_ip_literal(name) or name in self._names

    def describe(self) -> str:
        if self.loopback:
            return "this API serves loopback only"
        return f"this API answers to its addresses and {', '.join(sorted(self._names))} only"


def multiaddr_names(addrs: Iterable[str]) -> list[str]:
    """The DNS names in multiaddrs ('/dns4/peer.example.org/tcp/4001' -> that name)."""
    out: list[str] = []
    for addr in addrs:
        parts = addr.split("/")
        for i, proto in enumerate(parts[:-1]):
            if proto in ("dns", "dns4", "dns6", "dnsaddr") and parts[i + 1]:
                out.append(parts[i + 1])
    return out


class BrowserGuard:
    """ASGI middleware: 415 for a POST whose body is not declared JSON; with `hosts`,
    421 for a request whose Host it does not allow (``on_refused`` counts both).
    Without `hosts` (an app not bound by serve_http) the Host is not checked."""

    def __init__(
        self, app: ASGIApp, hosts: AllowedHosts | None, on_refused: Callable[[str, int], None]
    ) -> None:
        self._app = app
        self._hosts = hosts
        self._on_refused = on_refused

    def _refusal(self, scope: Scope) -> ApiError | None:
        if self._hosts is not None:
            host = _header(scope, b"host")
            if host is None or not self._hosts.allows(_host_name(host)):
                shown = (host or b"").decode("latin-1")[:100]
                return ApiError(
                    421, f"{self._hosts.describe()}; Host {shown!r} is not one of them "
                    "(a page on another site may not reach it through your browser)",
                    code="misdirected_request",
                )
        if scope.get("method") == "POST":
            given = (_header(scope, b"content-type") or b"").split(b";", 1)[0].strip().lower()
            if given != JSON_MEDIA_TYPE:
                return ApiError(
                    415, "the request body must be JSON: send 'Content-Type: application/json'",
                    code="unsupported_media_type",
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self._app(scope, receive, send)
            return
        self._on_refused(str(refusal.code), refusal.status)
        await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)

