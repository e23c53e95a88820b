"""Routes of the peer's page: `/`, its assets under `/web/`, and `/v1/requests`.

The page polls `/v1/swarm` (the table) and `/v1/requests` (this peer's counters, its
RequestLog and its CacheHistory, sampled once a summary interval by `Page.sample_forever`
in the HTTP server's nursery); it talks to the OpenAI endpoints for its prompt box. Assets
are read once, from the package, and served from a fixed list: no path from a request
reaches the disk.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from peer.api.face import FacePeer
from peer.api.metrics import Metrics
from peer.request.request_log import CacheHistory

ASSETS = {  # name -> media type; the only files served
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
# The page and its files hold no data: with an API key set they stay open (the page then
# asks for the key); everything they show comes from the API, which needs the key.
PAGE_PATHS = frozenset({"/", *(f"/web/{name}" for name in ASSETS if name != "index.html")})
# The page loads only its own files and talks only to its own peer.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    """The bytes of one of ASSETS (KeyError for any other name)."""
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files(__package__).joinpath(name).read_bytes()


def _asset_response(name: str) -> Response:
    return Response(asset(name), media_type=ASSETS[name], headers=PAGE_HEADERS)


async def index(request: Request) -> Response:
    return _asset_response("index.html")


async def web_asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS or name == "index.html":
        return JSONResponse(
            {"error": {"message": f"no such file: /web/{name}", "type": "invalid_request_error",
                       "param": None, "code": "not_found"}},
            status_code=404,
        )
    return _asset_response(name)


def activity_view(peer: FacePeer, history: CacheHistory | None = None) -> dict[str, Any]:
    """This peer's request counters, its engine's prefix hits, and its recent requests."""
    stats = peer.statistics()
    serving = stats.get("serving") or {}
    pipeline = serving.get("pipeline") or {}
    inference = serving.get("inference") or {}
    engine = stats.get("engine") or {}
    prompt = int(engine.get("prompt_tokens", 0))
    cached = int(engine.get("cached_tokens", 0))
    log = peer.request_log
    now = trio.current_time()
    return {
        "peer_id": peer.peer_id,
        "summary_interval_s": peer.config.summary_interval_s,
        "summary_expiry_s": peer.config.summary_expiry_s,  # silent this long: gone
        "requests": {
            "entered": int(pipeline.get("requests", 0)),  # clients' requests entering here
            "served_here": int(pipeline.get("served_local", 0)),
            "forwarded": int(pipeline.get("served_remote", 0)),  # ...completed elsewhere
            "served_for_others": int(inference.get("ok", 0)),  # other entries' requests
            "by_outcome": serving.get("requests") or {},
        },
        "engine": {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_ratio": cached / prompt if prompt else None,
        },
        "recent": log.as_json(now) if log is not None else [],
        "history": history.as_json(now) if history is not None else [],
    }


class Page:
    """The page of a peer's HTTP API: `.routes`, and the history that `sample_forever`
    keeps (run it in the server's nursery)."""

    def __init__(self, peer: FacePeer, metrics: Metrics) -> None:
        self._peer = peer
        self._metrics = metrics
        self.history = CacheHistory()
        self.routes = [
            Route("/", index, methods=["GET"]),
            Route("/web/{name}", web_asset, methods=["GET"]),
            Route("/v1/requests", self.requests, methods=["GET"]),
        ]

    async def requests(self, request: Request) -> JSONResponse:
        self._metrics.record_request("requests", 200)
        return JSONResponse(activity_view(self._peer, self.history))

    async def sample_forever(self) -> None:
        """A sample of the engine's cache every summary interval, until cancelled."""
        peer = self._peer
        while True:
            self.history.add(peer.cache_sample(trio.current_time()))
            await trio.sleep(peer.config.summary_interval_s)
