"""Optimistic protocol selection: a stream that carries its first message before the peer
has agreed on the protocol (multistream-select's "V1Lazy" in rust-libp2p).

A forward opens a stream to a peer whose summary says it serves inference: the protocol
is known. Waiting for the negotiation's echo before sending the request costs a round trip
on every forward (with peer/net/pipelined_select.py, one; py-libp2p alone, two). Here the
multistream header, the proposal and the first message leave in one flight; the peer's
echo of the header and the proposal is checked on the stream's first read, before any
byte of its answer is handed on. A peer that refuses the protocol answers "na", reads the
request as a malformed proposal and ends the stream: the first read raises
MultiselectClientError (a libp2p error, so callers see a broken stream).

Only for one protocol on an established connection (peer.net.host.SwarmHost.new_stream
with `lazy=True`); a stream that must dial or go through a relay negotiates as before.
The responder is unchanged: it reads the header, the proposal, then the request, in order.
"""

from __future__ import annotations

from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID
from libp2p.protocol_muxer.multiselect_client import is_valid_handshake
from libp2p.utils.varint import encode_delim, read_varint_prefixed_bytes_limited

__all__ = ["MAX_MESSAGE_BYTES", "LazyStream", "proposal_bytes"]

MAX_MESSAGE_BYTES = 1024  # a multistream message names a protocol: longer is hostile


def proposal_bytes(protocol: str) -> bytes:
    """The multistream header and the proposal of `protocol`, as one write."""
    return encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim(protocol.encode())


class LazyStream:
    """A stream proposed with `proposal_bytes` and not yet answered: writes go out at
    once; the first read checks the peer's echo of the header and of the protocol."""

    direct = True  # on a connection already held: no dial, relay or negotiation before it

    def __init__(self, stream: INetStream, protocol: TProtocol) -> None:
        self._stream = stream
        self._protocol = protocol
        self._echo: bool | None = None  # the peer's echo: None unread, True checked,
        #   False a check failed or was cut short (the stream is unusable: never parse an
        #   answer's bytes as the negotiation's)

    async def _message(self) -> str:
        """One multistream message: a bounded length prefix, then a line."""
        data = await read_varint_prefixed_bytes_limited(self._stream, MAX_MESSAGE_BYTES)
        if not data.endswith(b"\n"):
            raise MultiselectClientError(f"malformed multistream message: {data[:64]!r}")
        return data[:-1].decode(errors="replace")

    async def _settle(self) -> None:
        header = await self._message()
        if not is_valid_handshake(header):
            raise MultiselectClientError(f"multiselect protocol ID mismatch: got {header!r}")
        response = await self._message()
        if response != self._protocol:
            raise MultiselectClientError(
                f"peer did not accept {self._protocol!r}: answered {response!r}")

    async def read(self, n: int | None = None) -> bytes:
        if self._echo is not True:
            if self._echo is False:
                raise MultiselectClientError("the protocol negotiation failed earlier")
            self._echo = False  # until the check completes
            await self._settle()
            self._echo = True
        return await self._stream.read(n)

    async def write(self, data: bytes) -> None:
        await self._stream.write(data)

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()
