"""Protocol negotiation in one round trip: the multistream header and the first proposal
sent together, as go-libp2p and rust-libp2p do.

py-libp2p 0.8.1's MultiselectClient writes the multistream header, waits for its echo,
then writes the protocol and waits again: two round trips before a stream carries a
byte, so a forward at one-way delay d paid 6d before its first token came back, not 4d
(measured in the testbed at d = 50 ms: 3.08 round trips over a request served at home).
The responder reads messages one by one from the stream, so nothing changes on its side:
it answers the header, then the proposal. Further proposals, after a "na", go one at a
time as before. Only streams of an established connection are negotiated this way; a
connection's upgrade (security, then muxer) keeps py-libp2p's sequence. Installed by
peer/net/libp2p_fixes.py (WORKAROUND(select-rtt)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.protocol_muxer.exceptions import (
    MultiselectClientError,
    MultiselectCommunicatorError,
    ProtocolNotSupportedError,
)
from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID, PROTOCOL_NOT_FOUND_MSG
from libp2p.protocol_muxer.multiselect_client import (
    DEFAULT_NEGOTIATE_TIMEOUT,
    MultiselectClient,
    is_valid_handshake,
)

MARKER = "_prefixswarm_pipelined"
_ORIGINAL = MultiselectClient.select_one_of  # py-libp2p's, for connection upgrades


async def _write(communicator: Any, message: str) -> None:
    try:
        await communicator.write(message)
    except MultiselectCommunicatorError as error:
        raise MultiselectClientError(f"multiselect write failed: {error}") from error


async def _read(communicator: Any) -> str:
    try:
        return str(await communicator.read())
    except MultiselectCommunicatorError as error:
        raise MultiselectClientError(f"multiselect read failed: {error}") from error


async def select_one_of(self: MultiselectClient, protocols: Sequence[TProtocol],
                        communicator: Any,
                        negotiate_timeout: int = DEFAULT_NEGOTIATE_TIMEOUT) -> TProtocol:
    """MultiselectClient.select_one_of with the header and the first proposal in one
    flight on a stream of an established connection; the same errors
    (MultiselectClientError) on failure or timeout. A connection's own upgrade (security,
    muxer) negotiates as py-libp2p does."""
    if not isinstance(getattr(communicator, "read_writer", None), INetStream):
        return await _ORIGINAL(self, protocols, communicator, negotiate_timeout)
    if not protocols:
        raise MultiselectClientError("no protocols to select from")
    first = protocols[0]
    proposal = str(first) if first is not None else ""  # py-libp2p's spelling of None
    with trio.move_on_after(negotiate_timeout):
        await _write(communicator, MULTISELECT_PROTOCOL_ID)
        await _write(communicator, proposal)
        header = await _read(communicator)
        if not is_valid_handshake(header):
            raise MultiselectClientError(f"multiselect protocol ID mismatch: got {header!r}")
        response = await _read(communicator)
        if response == proposal:
            return first
        if response != PROTOCOL_NOT_FOUND_MSG:
            raise MultiselectClientError(
                f"unrecognized response: {response!r}, expected {first!r} or "
                f"{PROTOCOL_NOT_FOUND_MSG!r}")
        refused = [str(first)]
        for protocol in protocols[1:]:
            try:
                return await self.try_select(communicator, protocol)
            except ProtocolNotSupportedError:
                refused.append(str(protocol))
        raise MultiselectClientError(f"protocols not supported: {refused}")
    raise MultiselectClientError(
        f"response timed out after {negotiate_timeout}s, protocols tried: {list(protocols)}")


setattr(select_one_of, MARKER, True)


def install() -> None:
    MultiselectClient.select_one_of = select_one_of  # type: ignore[method-assign]


def installed() -> bool:
    return bool(getattr(MultiselectClient.select_one_of, MARKER, False))
