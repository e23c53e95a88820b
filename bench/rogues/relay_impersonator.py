"""relay_impersonator: a peer offered as a relay that reads, rewrites and impersonates.

Installed on the rogue's own running `Peer` (bench tool: production code has no attack
mode), it changes that peer's relay (peer/net/relay_server.py) from the outside:
- it logs every byte it forwards, per circuit and direction, to files under a dump
  directory (bench/adversary_relay.py searches them for the relayed prompts and answers);
- it parses what it forwards as plaintext inference frames where it can, and rewrites
  the token ids of every answer chunk it can parse (what a relay of plain streams does);
- after `HONEST_CIRCUITS` honest inference circuits it attacks every further one, in
  turn: flipping bits of the answer after the first message back (blind rewriting), or
  answering the circuit itself as the target, once with its own Noise handshake and
  once in the clear with made-up tokens.
Counts go out in the rogue's stats lines under "relay".
"""

from __future__ import annotations

import contextvars
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair

from peer.net.relay_channel import RelayAuthError, secure_inbound
from peer.net.relay_server import RelayReply, close_stream
from protocols.errors import RemoteProtocolError
from protocols.framing import FrameDecoder, encode_frame
from protocols.ids import INFER_PROTOCOL
from protocols.infer import KIND_CHUNK, KIND_REQUEST

logger = logging.getLogger("bench.rogue")

HONEST_CIRCUITS = 6  # inference circuits relayed faithfully (and logged) before attacking
MAX_DUMP_BYTES = 64 << 20  # all circuits together
ATTACKS = ("tamper", "impersonate_noise", "impersonate_plain")

_protocol: contextvars.ContextVar[str] = contextvars.ContextVar("relayed_protocol", default="")
_attack: contextvars.ContextVar[str] = contextvars.ContextVar("relay_attack", default="")


class PlaintextProbe:
    """Parses one direction of a circuit as inference frames while that works: what a
    relay of unencrypted streams reads (prompts) and could rewrite (answer tokens)."""

    def __init__(self) -> None:
        self._decoder: FrameDecoder | None = FrameDecoder()
        self.prompts_seen = 0
        self.prompt_tokens_seen = 0
        self.chunks_seen = 0

    def feed(self, data: bytes) -> None:
        if self._decoder is None:
            return
        try:
            self._decoder.feed(data)
            while (frame := self._decoder.next_frame()) is not None:
                if isinstance(frame, dict) and frame.get("t") == KIND_REQUEST:
                    self.prompts_seen += 1
                    self.prompt_tokens_seen += len(frame.get("prompt") or ())
                elif isinstance(frame, dict) and frame.get("t") == KIND_CHUNK:
                    self.chunks_seen += 1
        except (RemoteProtocolError, ValueError):
            self._decoder = None  # not frames: ciphertext (or garbage) from here on


def rewrite_tokens(data: bytes) -> bytes | None:
    """The same bytes with every token id of an answer chunk changed, if `data` is whole
    plaintext frames; None when it cannot be parsed (ciphertext)."""
    decoder = FrameDecoder()
    out = b""
    try:
        decoder.feed(data)
        while (frame := decoder.next_frame()) is not None:
            if isinstance(frame, dict) and frame.get("t") == KIND_CHUNK:
                frame = {**frame, "tokens": [(t + 1) % 1000 for t in frame["tokens"]]}
            out += encode_frame(frame)
    except (RemoteProtocolError, ValueError, TypeError, KeyError):
        return None
    return out if decoder.buffered == 0 and out else None


class RelayImpersonator:
    """The attack, installed on one peer's relay server."""

    def __init__(self, peer: Any, dump_dir: Path) -> None:
        self._peer = peer
        self._server = peer.host.reach._relay
        self._dump_dir = dump_dir
        dump_dir.mkdir(parents=True, exist_ok=True)
        self._dumped = 0
        self._circuits = 0
        self._infer_circuits = 0
        self.stats: Counter[str] = Counter()

    def install(self) -> None:
        serve_connect = self._server._serve_connect

        async def connect(stream: Any, origin: str, request: Any) -> None:
            _protocol.set(request.protocol)
            attack = ""
            if request.protocol == INFER_PROTOCOL:
                self._infer_circuits += 1
                beyond = self._infer_circuits - HONEST_CIRCUITS
                if beyond > 0:
                    attack = ATTACKS[(beyond - 1) % len(ATTACKS)]
            _attack.set(attack)
            if attack.startswith("impersonate"):
                await self._impersonate(stream, request.protocol, attack)
            else:
                await serve_connect(stream, origin, request)

        self._server._serve_connect = connect
        self._server._pipe = self._pipe

    def _identity(self) -> KeyPair:
        libp2p = self._peer.host.libp2p
        return KeyPair(libp2p.get_private_key(), libp2p.get_public_key())

    async def _impersonate(self, stream: Any, protocol: str, how: str) -> None:
        """Answer the circuit ourselves, as if we were the target."""
        self.stats[how] += 1
        try:
            await stream.write(RelayReply(True).encode())
            if how == "impersonate_noise":
                with trio.move_on_after(10):
                    secured = await secure_inbound(stream, self._identity(), protocol)
                    self.stats["impersonation_accepted"] += 1  # the entry took our identity
                    await secured.write(_fake_answer())
            else:
                with trio.move_on_after(10):
                    await stream.write(_fake_answer())
                    await stream.read(65536)
        except (RelayAuthError, Exception) as exc:  # the entry refused us: the expected end
            logger.debug("impersonation (%s) ended: %r", how, exc)
        finally:
            await close_stream(stream)

    async def _pipe(self, a: Any, b: Any) -> None:
        """RelayServer._pipe, logging every byte, probing and rewriting it."""
        self._circuits += 1
        circuit, protocol, attack = self._circuits, _protocol.get(), _attack.get()
        if attack == "tamper":
            self.stats["tamper"] += 1
        self.stats["circuits"] += 1
        self.stats[f"circuits_{protocol.strip('/').replace('/', '_')}"] += 1

        async def copy(src: Any, dst: Any, direction: str) -> None:
            probe = PlaintextProbe()
            path = self._dump_dir / f"circuit-{circuit:05d}-{direction}.bin"
            index = 0
            try:
                with path.open("ab") as dump:
                    while data := await src.read(64 * 1024):
                        self.stats["bytes_seen"] += len(data)
                        if self._dumped < MAX_DUMP_BYTES:
                            dump.write(data)
                            self._dumped += len(data)
                        probe.feed(data)
                        if direction == "back" and protocol == INFER_PROTOCOL:
                            rewritten = rewrite_tokens(data)
                            if rewritten is not None:
                                self.stats["answers_rewritten"] += 1
                                data = rewritten
                            elif attack == "tamper" and index > 0:
                                data = data[:-1] + bytes([data[-1] ^ 0x01])
                                self.stats["messages_tampered"] += 1
                        index += 1
                        await dst.write(data)
            except Exception as exc:  # EOF/reset ends the circuit
                logger.debug("rogue relay pipe: %r", exc)
            finally:
                self.stats["plaintext_prompts_parsed"] += probe.prompts_seen
                self.stats["plaintext_prompt_tokens_parsed"] += probe.prompt_tokens_seen
                self.stats["plaintext_chunks_parsed"] += probe.chunks_seen
                nursery.cancel_scope.cancel()

        with trio.move_on_after(self._server.limits.max_circuit_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy, a, b, "forward")
                nursery.start_soon(copy, b, a, "back")

    def report(self) -> dict[str, int]:
        return dict(self.stats)


def _fake_answer() -> bytes:
    """What an impersonator says as the target: made-up tokens and a result."""
    chunk = {"t": KIND_CHUNK, "tokens": [42, 43, 44], "text": "forged"}
    return encode_frame(chunk)


def install(peer: Any, dump_dir: Path) -> RelayImpersonator:
    impersonator = RelayImpersonator(peer, dump_dir)
    impersonator.install()
    return impersonator
