"""End-to-end security through a relay: a Noise XX handshake over the relayed stream.

A relay joins two streams and sees every byte on them. Over that joined stream the
entry (initiator) and the target (responder) run libp2p's own Noise XX handshake
(`libp2p.security.noise.patterns.PatternXX`, Noise_XX_25519_ChaChaPoly_SHA256): each
side signs a fresh X25519 static key with its libp2p identity key, so the initiator
learns the target's peer id and the target the initiator's, proven. The handshake's
prologue names the relayed protocol: a relay that switches it breaks the handshake.

After it, every byte the relay carries is ChaCha20-Poly1305 ciphertext with a counter
nonce: the relay reads nothing, and a changed, dropped, replayed or reordered message
fails authentication (`RelayChannelError`), so a relay can end a stream but never put
words in either side's mouth. The entry accepts a relayed stream only when the
handshake proved the peer id it asked for (`RelayAuthError` otherwise): a relay cannot
answer as the target, nor stand up a forged or unconnected identity. The target's
handlers see the proven origin as the stream's peer, never the relay.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import trio
from libp2p.abc import IRawConnection
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.exceptions import BaseLibp2pError
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError, IOException
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.security.noise.patterns import PatternXX
from libp2p.security.secure_session import SecureSession

from protocols.errors import RemoteProtocolError

logger = logging.getLogger(__name__)

PROLOGUE_PREFIX = b"/prefixswarm/relay-e2e/1.0.0\n"  # then the relayed protocol id
HANDSHAKE_TIMEOUT_S = 5.0  # three messages through a relay: 1.5 round trips plus signatures


class RelayChannelError(IOException):
    """A relayed message failed authentication: the relay (or the path) changed it.

    A libp2p IOException, so the stream readers above (peer/net/wire.py) treat it as a
    broken stream: the attempt fails, and no byte of the changed message is used."""


class RelayAuthError(Exception):
    """The handshake through a relay failed or proved another identity than expected.

    `meddled`: the relay (or the path) sent something no honest pair sends: another
    identity, a bad signature, a message that fails its tag. False when the stream just
    ended or went quiet (a target that left or refused the circuit): no reason to
    distrust the relay."""

    def __init__(self, message: str, *, meddled: bool) -> None:
        super().__init__(message)
        self.meddled = meddled


# How an honest circuit ends early: the target left, refused it, or the stream was reset.
_ENDED = (IncompleteReadError, StreamEOF, StreamReset, StreamClosed, ConnectionClosedError,
          EOFError)


def prologue(protocol: str) -> bytes:
    """What both sides mix into the handshake: the protocol the stream will carry."""
    return PROLOGUE_PREFIX + protocol.encode()


@dataclass(frozen=True)
class _Remote:
    """What `stream.muxed_conn` gives a handler: the peer the handshake proved."""

    peer_id: ID

    def get_remote_address(self) -> None:
        return None  # relayed: no socket of ours leads to this peer


class SecuredStream:
    """A relayed stream after the handshake: the INetStream surface handlers and
    forwards use (read, write, close, reset, muxed_conn.peer_id), end to end encrypted.

    `muxed_conn.peer_id` is the proven remote, never the relay; `relay` is the relay."""

    def __init__(self, session: SecureSession, raw: Any, protocol: str) -> None:
        self._session = session
        self._raw = raw  # the relayed stream under it: reset and close go there
        self.protocol = protocol
        self.remote_peer: ID = session.get_remote_peer()
        self.muxed_conn = _Remote(self.remote_peer)
        # the carrier, the peer at the socket's end (None for a stream on no connection)
        self.relay: ID | None = getattr(getattr(raw, "muxed_conn", None), "peer_id", None)
        self._pending = b""
        self.on_tampered: Callable[[], None] = lambda: None  # e.g. avoid that relay

    def get_protocol(self) -> str:
        return self.protocol

    def get_remote_address(self) -> None:
        return None

    async def read(self, n: int | None = None) -> bytes:
        """Up to n bytes (a muxed stream's short read; SecureSession.read(n) would wait
        for exactly n): what is buffered, else the next decrypted message."""
        if not self._pending:
            self._pending = await self._next_message()
        if n is None or n >= len(self._pending):
            data, self._pending = self._pending, b""
        else:
            data, self._pending = self._pending[:n], self._pending[n:]
        return data

    async def _next_message(self) -> bytes:
        try:
            return await self._session.read(None)
        except BaseLibp2pError:
            raise  # EOF, reset: the stream ended (wire.py's readers handle these)
        except Exception as exc:  # noise raises NoiseInvalidMessage on a bad tag
            self.on_tampered()
            raise RelayChannelError(f"relayed message failed authentication: {exc!r}") from exc

    async def write(self, data: bytes) -> None:
        await self._session.write(data)

    async def close(self) -> None:
        await self._raw.close()

    async def reset(self) -> None:
        await self._raw.reset()


def _ephemeral_pattern(identity: KeyPair, protocol: str) -> PatternXX:
    """XX with a fresh X25519 static key per stream, signed by the identity key."""
    return PatternXX(
        ID.from_pubkey(identity.public_key),
        identity.private_key,
        create_x25519_key_pair().private_key,
        prologue=prologue(protocol),
    )


async def secure_outbound(
    stream: Any, identity: KeyPair, expected: ID, protocol: str
) -> SecuredStream:
    """The entry's side: a SecuredStream whose remote is proven to be `expected`;
    RelayAuthError (the stream is left to the caller to close) otherwise."""
    pattern = _ephemeral_pattern(identity, protocol)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            session = await pattern.handshake_outbound(cast(IRawConnection, stream), expected)
    except trio.TooSlowError as exc:
        raise RelayAuthError(
            f"no handshake from {expected} within {HANDSHAKE_TIMEOUT_S} s", meddled=False
        ) from exc
    except _ENDED as exc:
        raise RelayAuthError(f"circuit to {expected} ended: {exc!r}", meddled=False) from exc
    except Exception as exc:  # bad signature, another identity, garbage
        raise RelayAuthError(f"handshake with {expected} failed: {exc!r}", meddled=True) from exc
    assert isinstance(session, SecureSession)
    if session.get_remote_peer() != expected:  # checked by the pattern; never trust one check
        raise RelayAuthError(
            f"handshake proved {session.get_remote_peer()}, not {expected}", meddled=True
        )
    return SecuredStream(session, stream, protocol)


async def secure_inbound(stream: Any, identity: KeyPair, protocol: str) -> SecuredStream:
    """The target's side: a SecuredStream whose remote is the initiator the handshake
    proved; RelayAuthError otherwise."""
    pattern = _ephemeral_pattern(identity, protocol)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            session = await pattern.handshake_inbound(cast(IRawConnection, stream))
    except trio.TooSlowError as exc:
        raise RelayAuthError(f"no handshake within {HANDSHAKE_TIMEOUT_S} s", meddled=False) from exc
    except _ENDED as exc:
        raise RelayAuthError(f"circuit ended: {exc!r}", meddled=False) from exc
    except Exception as exc:  # as above
        raise RelayAuthError(f"inbound handshake failed: {exc!r}", meddled=True) from exc
    assert isinstance(session, SecureSession)
    return SecuredStream(session, stream, protocol)


async def accept_circuit(
    stream: Any,
    identity: KeyPair,
    *,
    relay_allowed: Callable[[str], bool],
    handler_for: Callable[[str], Callable[[Any], Awaitable[None]] | None],
    stats: Counter[str],
) -> None:
    """The target's side of a circuit (a /prefixswarm/relay-stop/1.0.0 stream from a
    relay): only from a relay we hold a reservation on, for a relayed protocol we
    serve; the handshake proves the origin, and the protocol's own handler then gets
    the SecuredStream as if the origin had opened it directly."""
    from peer.net.relay_server import RelayStop, close_stream, read_control

    relay = stream.muxed_conn.peer_id.to_base58()
    try:
        if not relay_allowed(relay):
            raise RemoteProtocolError("a circuit from a relay we hold no reservation on")
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            stop = RelayStop.parse(await read_control(stream))
        handler = handler_for(stop.protocol)
        if handler is None:
            raise RemoteProtocolError(f"no handler for {stop.protocol}")
        secured = await secure_inbound(stream, identity, stop.protocol)
    except (RemoteProtocolError, RelayAuthError, trio.TooSlowError) as exc:
        stats["relayed_inbound_refused"] += 1
        logger.debug("circuit through %s refused: %s", relay, exc)
        await close_stream(stream)
        return
    except Exception as exc:  # a relay's stream: EOF, reset, garbage; muxers vary
        stats["relayed_inbound_refused"] += 1
        logger.debug("circuit through %s broke: %r", relay, exc)
        await close_stream(stream)
        return
    if secured.remote_peer.to_base58() != stop.origin:  # the relay named someone else
        stats["relayed_inbound_refused"] += 1
        logger.debug("circuit through %s: origin %s claimed, %s proven", relay, stop.origin,
                     secured.remote_peer)
        await close_stream(stream)
        return
    stats["relayed_inbound"] += 1
    await handler(secured)
