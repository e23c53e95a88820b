"""A topic joined or left while a pubsub stream is being opened reaches that peer
(peer/net/pubsub_hello.py): two real hosts on loopback, with the hello's write held
open while one of them changes its subscriptions."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
from libp2p.pubsub.pubsub import Pubsub

from peer.config import PeerConfig
from peer.net import pubsub_hello
from peer.net.host import open_host
from peer.net.host_services import new_pubsub, run_service

TOPIC = "/prefixswarm/summary/1/hello-test"
KEPT = "/prefixswarm/summary/1/kept"  # in every hello: B has read A's hello once it knows


def test_only_what_the_hello_got_wrong_is_announced() -> None:
    announce = pubsub_hello.topics_to_announce
    assert announce({"a", "b"}, {"a", "b"}) == []
    assert announce({"a", "gone"}, {"a", "new"}) == [("new", True), ("gone", False)]


class _HeldStream:
    """A pubsub stream whose first write (the hello) waits for `release`."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._held = stream, True
        self.writing, self.release = trio.Event(), trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def write(self, data: bytes) -> None:
        if self._held:
            self._held = False
            self.writing.set()
            await self.release.wait()
        await self._stream.write(data)


@pytest.mark.parametrize("joined_before", [False, True])
async def test_a_subscription_changed_during_the_hello_reaches_the_peer(
    joined_before: bool,
) -> None:
    config = PeerConfig(
        model="test/model", listen_addrs=("/ip4/127.0.0.1/tcp/0",), identity_file=None
    )
    async with AsyncExitStack() as stack:
        a, b = [await stack.enter_async_context(open_host(config)) for _ in range(2)]
        pubsub_a, pubsub_b = (new_pubsub(h, degree=3, degree_low=2, degree_high=4) for h in (a, b))
        for pubsub in (pubsub_a, pubsub_b):
            await stack.enter_async_context(run_service(pubsub))
            await stack.enter_async_context(run_service(pubsub.router))
        await pubsub_a.subscribe(KEPT)
        if joined_before:
            await pubsub_a.subscribe(TOPIC)
        held: list[_HeldStream] = []
        new_stream = pubsub_a.host.new_stream

        async def holding(peer_id: Any, protocols: Any) -> Any:
            stream = await new_stream(peer_id, protocols)
            if not any(p.startswith("/meshsub/") for p in protocols):
                return stream  # identify, the DHT: not pubsub
            held.append(_HeldStream(stream))
            return held[-1]

        pubsub_a.host.new_stream = holding  # type: ignore[method-assign]
        with trio.fail_after(10):
            await a.connect(b.multiaddrs[0])
            while not held:
                await trio.sleep(0.01)
            await held[0].writing.wait()  # A's hello to B is built and on its way
            if joined_before:
                await pubsub_a.unsubscribe(TOPIC)
            else:
                await pubsub_a.subscribe(TOPIC)
            held[0].release.set()
            while pubsub_a.my_id not in pubsub_b.peer_topics.get(KEPT, ()):
                await trio.sleep(0.01)
            while (pubsub_a.my_id in pubsub_b.peer_topics.get(TOPIC, ())) == joined_before:
                await trio.sleep(0.01)


def test_the_fix_stands_aside_when_a_method_it_wraps_takes_other_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def changed(self: object, peer_id: object, extra: int) -> None: ...

    monkeypatch.setattr(Pubsub, "_handle_new_peer", changed)
    assert pubsub_hello.problem() == (
        "Pubsub._handle_new_peer takes ('self', 'peer_id', 'extra'), expected ('self', 'peer_id')"
    )
