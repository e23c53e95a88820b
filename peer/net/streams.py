"""What the request path uses of py-libp2p, as narrow Protocols.

The pipeline, a forward and a load probe open streams (`StreamOpener`: peer.net.host's
SwarmHost, tests/fake_host.py); serving registers the handlers of the protocols it
answers (`HandlerHost`: the raw py-libp2p host) and reads the streams other peers open
(`InboundStream`: py-libp2p's INetStream). Nothing above these needs more of libp2p.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.peer.id import ID

__all__ = ["HandlerHost", "InboundStream", "StreamLike", "StreamOpener"]


class StreamLike(Protocol):
    """One bidirectional stream (py-libp2p's INetStream; the fake host's in tests)."""

    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close(self) -> None: ...
    async def reset(self) -> None: ...


class StreamOpener(Protocol):
    """What a forward and a load probe use of the libp2p host (peer.net.host.SwarmHost;
    tests/fake_host.py)."""

    async def new_stream(
        self, peer_id: ID, protocols: Sequence[str], *, timeout_s: float = ...
    ) -> StreamLike: ...


class _RemotePeer(Protocol):
    @property
    def peer_id(self) -> ID: ...


class InboundStream(StreamLike, Protocol):
    """A stream another peer opened to us: its connection names that peer."""

    @property
    def muxed_conn(self) -> _RemotePeer: ...


class HandlerHost(Protocol):
    """What serving uses of the raw py-libp2p host: a handler per protocol it answers.

    The handler is called with py-libp2p's INetStream, which is an `InboundStream`."""

    def set_stream_handler(self, protocol_id: TProtocol, stream_handler: StreamHandlerFn) -> None:
        ...
