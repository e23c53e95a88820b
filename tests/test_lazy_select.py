"""Optimistic protocol selection (peer/net/lazy_select.py): the first message leaves with
the proposal, before any answer is read; the peer's echo is checked on the first read; a
refusal is an error there, and a peer that held no connection negotiates as before."""

from __future__ import annotations

import multiaddr
import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.io.exceptions import MessageTooLarge
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.utils.varint import encode_delim, encode_varint_prefixed

from peer.config import PeerConfig
from peer.net.host import open_host
from peer.net.lazy_select import MAX_MESSAGE_BYTES, LazyStream, proposal_bytes

ECHO = TProtocol("/test/echo/1")
HEADER = b"/multistream/1.0.0"


def _config() -> PeerConfig:
    return PeerConfig(model="test/model", listen_addrs=("/ip4/127.0.0.1/tcp/0",),
                      identity_file=None)


class Scripted:
    """A raw stream whose reads come from `incoming` and which logs every write and read."""

    def __init__(self, incoming: bytes) -> None:
        self.incoming = incoming
        self.log: list[str] = []

    async def read(self, n: int | None = None) -> bytes:
        self.log.append("r")
        size = len(self.incoming) if n is None else n
        data, self.incoming = self.incoming[:size], self.incoming[size:]
        return data

    async def write(self, data: bytes) -> None:
        self.log.append("w")

    async def close(self) -> None: ...
    async def reset(self) -> None: ...


def _echoes(protocol: str, rest: bytes = b"") -> bytes:
    return encode_delim(HEADER) + encode_delim(protocol.encode()) + rest


async def test_writes_go_out_before_any_answer_is_read() -> None:
    raw = Scripted(_echoes(ECHO, b"answer"))
    stream = LazyStream(raw, ECHO)  # type: ignore[arg-type]
    await stream.write(b"request")
    assert raw.log == ["w"]  # no read before the request went out
    assert await stream.read(6) == b"answer"  # the echoes are consumed, not handed on


async def test_a_refusal_or_a_wrong_header_fails_the_first_read() -> None:
    with pytest.raises(MultiselectClientError, match="did not accept"):
        await LazyStream(Scripted(_echoes("na")), ECHO).read()  # type: ignore[arg-type]
    wrong = encode_delim(b"/other/1.0.0") + encode_delim(ECHO.encode())
    with pytest.raises(MultiselectClientError, match="mismatch"):
        await LazyStream(Scripted(wrong), ECHO).read()  # type: ignore[arg-type]


async def test_an_oversize_or_unterminated_answer_is_refused() -> None:
    huge = encode_varint_prefixed(b"x" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(MessageTooLarge):  # refused on its length, before its body is read
        await LazyStream(Scripted(huge), ECHO).read()  # type: ignore[arg-type]
    with pytest.raises(MultiselectClientError, match="malformed"):
        await LazyStream(Scripted(encode_varint_prefixed(HEADER)), ECHO).read()  # type: ignore[arg-type]


async def test_a_failed_negotiation_is_not_read_again() -> None:
    stream = LazyStream(Scripted(_echoes("na", b"answer")), ECHO)  # type: ignore[arg-type]
    with pytest.raises(MultiselectClientError, match="did not accept"):
        await stream.read()
    with pytest.raises(MultiselectClientError, match="failed earlier"):
        await stream.read()


def test_the_proposal_is_the_header_and_the_protocol() -> None:
    assert proposal_bytes(ECHO) == encode_delim(HEADER) + encode_delim(ECHO.encode())


async def test_a_lazy_stream_between_real_hosts() -> None:
    async def echo(stream: object) -> None:
        data = await stream.read(64)  # type: ignore[attr-defined]
        await stream.write(b"echo:" + data)  # type: ignore[attr-defined]
        await stream.close()  # type: ignore[attr-defined]

    with trio.fail_after(20):
        async with open_host(_config()) as a, open_host(_config()) as b:
            a.libp2p.set_stream_handler(ECHO, echo)
            info = info_from_p2p_addr(multiaddr.Multiaddr(a.multiaddrs[0]))
            b.libp2p.get_peerstore().add_addrs(info.peer_id, info.addrs, 60)
            assert not b.is_connected(a.peer_id)
            first = await b.new_stream(a.peer_id, [ECHO], lazy=True)
            assert not isinstance(first, LazyStream)  # no connection yet: negotiated first
            await first.write(b"first")
            assert await first.read(64) == b"echo:first"
            stream = await b.new_stream(a.peer_id, [ECHO], lazy=True)
            assert isinstance(stream, LazyStream)
            await stream.write(b"hello")
            assert await stream.read(64) == b"echo:hello"
            refused = await b.new_stream(a.peer_id, ["/test/unknown/1"], lazy=True)
            await refused.write(b"hello")
            with pytest.raises(BaseLibp2pError):
                await refused.read(64)
