"""What the faces (the HTTP API, the peer's page) use of a peer: `FacePeer`.

peer.node.Peer implements it. A face generates only through `generation` (the one
`GenerationService`, peer/request/generation.py) and reads the peer only through these views, so
the import graph shows every call a face makes and a test can hand it a small fake.
Plain types and a Protocol: no trio, libp2p or torch (a pure module, mypy --strict).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from peer.config import PeerConfig
from peer.request.generation import GenerationService
from peer.request.request_log import CacheSample, RequestLog

__all__ = ["FacePeer"]


class FacePeer(Protocol):
    """A running peer as its HTTP API and page see it."""

    @property
    def peer_id(self) -> str: ...

    @property
    def config(self) -> PeerConfig: ...

    @property
    def model_id(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    @property
    def generation(self) -> GenerationService | None:
        """None when the peer cannot generate (a cache-only engine)."""
        ...

    @property
    def request_log(self) -> RequestLog | None: ...

    def statistics(self) -> dict[str, Any]:
        """Counters as plain JSON types (peer.node.Peer.statistics)."""
        ...

    def swarm_view(self) -> dict[str, Any]:
        """This peer and its table as plain JSON (GET /v1/swarm)."""
        ...

    def cache_sample(self, now: float) -> CacheSample: ...

    def observe_queue_wait(self, observe: Callable[[float], None]) -> None: ...
