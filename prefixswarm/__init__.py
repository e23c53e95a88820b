"""prefixswarm as a library: embed a swarm peer in a program.

Trio programs use the peer directly::

    from prefixswarm import PeerConfig, SamplingParams, open_peer

    async with open_peer(PeerConfig(model="smollm2-135m")) as peer:
        result = await peer.generate("The capital of France is", SamplingParams(max_new_tokens=8))
        print(result.text, result.served_by)

asyncio (or plain blocking) programs run it in a Trio thread::

    from prefixswarm import PeerConfig, PeerThread

    async with PeerThread(PeerConfig(model="smollm2-135m")) as peer:
        result = await peer.agenerate("The capital of France is")   # peer.generate() blocks
        async for item in peer.astream("Once upon a time"):        # chunks, then the result
            ...

Defaults are safe for a library (prefixswarm.embed): the peer listens on loopback on a
port the OS picks (``/ip4/127.0.0.1/tcp/0``) and has an ephemeral identity. To be reached
from other machines give ``listen_addrs`` (e.g. ``("/ip4/0.0.0.0/tcp/4001",)``) and, for a
lasting peer id, ``identity_file``; join a swarm with ``bootstrap``. A given identity is
locked while the peer runs and fixed ports are checked first, as ``prefixswarm serve``
does; a problem is one ``ConfigError`` line before anything starts. The OpenAI-compatible
HTTP API is a service to start on the peer: ``await peer.start_service(serve_http, peer,
"127.0.0.1", 0)`` returns its URL. Examples: examples/embed_peer.py (Trio) and
examples/embed_asyncio.py.

  embed.py    open_peer and PeerConfig with the embedding defaults
  thread.py   PeerThread: the peer in its own Trio thread, blocking and asyncio calls

The peer itself is the package ``peer`` (the command line is ``peer.cli``).
"""

from peer.api.http import serve_http
from peer.engine.api import InvalidRequest, SamplingParams
from peer.node import Peer
from peer.request.admission import Overloaded
from peer.request.generation import (
    DeadlineExceeded,
    GenerationChunk,
    GenerationResult,
    RequestFailed,
)
from peer.settings import ConfigError
from prefixswarm.embed import EMBED_LISTEN, PeerConfig, open_peer
from prefixswarm.thread import PeerClosed, PeerThread

__all__ = [
    "EMBED_LISTEN",
    "ConfigError",
    "DeadlineExceeded",
    "GenerationChunk",
    "GenerationResult",
    "InvalidRequest",
    "Overloaded",
    "Peer",
    "PeerClosed",
    "PeerConfig",
    "PeerThread",
    "RequestFailed",
    "SamplingParams",
    "open_peer",
    "serve_http",
]
