"""peer.net.host: identity persistence, Noise-only security, dial/ping/stream
deadlines, clean close."""

from __future__ import annotations

import socket
import stat
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

from peer.config import PeerConfig
from peer.net.host import HostError, PeerUnreachable, load_or_create_identity, open_host

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def _config(identity: Path | None = None, listen: tuple[str, ...] = LOOPBACK) -> PeerConfig:
    return PeerConfig(model="test/model", listen_addrs=listen, identity_file=identity)


def test_identity_created_private_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.public_key.serialize() == first.public_key.serialize()
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_identity_none_is_ephemeral() -> None:
    a, b = load_or_create_identity(None), load_or_create_identity(None)
    assert a.public_key.serialize() != b.public_key.serialize()


def test_identity_corrupt_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(b"not a key")
    with pytest.raises(HostError, match="cannot load identity"):
        load_or_create_identity(path)


async def test_connect_ping_and_same_identity_after_restart(tmp_path: Path) -> None:
    key = tmp_path / "a.key"
    with trio.fail_after(20):
        async with open_host(_config(key)) as a, open_host(_config()) as b:
            first_id = a.peer_id
            assert all(addr.endswith(f"/p2p/{a.peer_id}") for addr in a.multiaddrs)
            assert await b.connect(a.multiaddrs[0]) == a.peer_id
            assert b.is_connected(a.peer_id)
            rtt = await b.ping(a.peer_id)
            assert 0 < rtt < 1.0
        async with open_host(_config(key)) as a2:
            assert a2.peer_id == first_id


async def test_dial_dead_address_fails_fast() -> None:
    with trio.fail_after(20):
        async with open_host(_config()) as a:
            addr = a.multiaddrs[0]
        async with open_host(_config()) as b:
            start = trio.current_time()
            with pytest.raises(PeerUnreachable):
                await b.connect(addr, timeout_s=3)
            assert trio.current_time() - start < 3


async def test_close_leaves_no_listener_and_no_zombie_connection() -> None:
    with trio.fail_after(20):
        async with open_host(_config()) as b:
            async with open_host(_config()) as a:
                port = int(multiaddr.Multiaddr(a.multiaddrs[0]).value_for_protocol("tcp"))
                await b.connect(a.multiaddrs[0])
                assert b.connected_peers() == [a.peer_id]
            # The listening socket is closed...
            with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                s.connect(("127.0.0.1", port))
            # ...and the other side sees the connection go (no zombie).
            while b.connected_peers():
                await trio.sleep(0.02)


async def test_restarted_peer_is_reachable_again(tmp_path: Path) -> None:
    key = tmp_path / "b.key"
    with trio.fail_after(20):
        async with open_host(_config()) as a:
            async with open_host(_config(key)) as b1:
                old_addr = b1.multiaddrs[0]
                await a.connect(old_addr)
            with pytest.raises(PeerUnreachable):  # all addresses failed: negative cache
                await a.connect(old_addr, timeout_s=3)
            async with open_host(_config(key)) as b2:
                assert await a.connect(b2.multiaddrs[0], timeout_s=3) == b2.peer_id
                assert await a.ping(b2.peer_id) > 0


async def test_listen_failure_is_an_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(10), pytest.raises(HostError, match="could not listen"):
            async with open_host(_config(listen=(f"/ip4/127.0.0.1/tcp/{port}",))):
                pass


async def test_stream_to_unsupported_protocol_fails_within_deadline() -> None:
    with trio.fail_after(20):
        async with open_host(_config()) as a, open_host(_config()) as b:
            await b.connect(a.multiaddrs[0])
            with pytest.raises(PeerUnreachable):
                await b.new_stream(a.peer_id, ["/prefixswarm/nothing/1.0.0"], timeout_s=3)


async def test_plaintext_only_peer_cannot_connect() -> None:
    kp = create_new_key_pair()
    plain = new_host(key_pair=kp, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)})
    with trio.fail_after(20):
        async with (
            open_host(_config()) as a,
            plain.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]),
        ):
            try:
                info_addr = multiaddr.Multiaddr(a.multiaddrs[0])
                with pytest.raises(Exception), trio.fail_after(10):  # noqa: B017
                    await plain.connect(info_from_p2p_addr(info_addr))
                assert a.connected_peers() == []
            finally:
                await plain.close()


async def test_reading_small_messages_does_not_answer_each_with_a_window_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    updates = 0
    original = YamuxStream.send_window_update

    async def counting(self: YamuxStream, *args: object, **kwargs: object) -> None:
        nonlocal updates
        updates += 1
        await original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(YamuxStream, "send_window_update", counting)
    messages = 40
    send_read, read = trio.open_memory_channel[int](messages)

    async def reader(stream: Any) -> None:
        for _ in range(messages):
            await send_read.send(len(await stream.read(100)))

    with trio.fail_after(20):
        async with open_host(_config()) as a, open_host(_config()) as b:
            a.libp2p.set_stream_handler(TProtocol("/prefixswarm/test/1.0.0"), reader)
            await b.connect(a.multiaddrs[0])
            stream = await b.new_stream(a.peer_id, ["/prefixswarm/test/1.0.0"])
            before = updates
            for _ in range(messages):
                await stream.write(b"x" * 100)
                assert await read.receive() == 100  # read before the next: one read each
            # 4 kB in 40 reads of a 256 kB window: nothing to give back yet.
            assert updates - before < messages // 4, f"{updates - before} window updates"
