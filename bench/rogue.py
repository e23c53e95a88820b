"""A hostile peer for bench.adversary: a real peer process that lies, stalls or forges.

    python -m bench.rogue --mode MODE --bootstrap MULTIADDR [--model tiny-random]
        [--identities 10] [--forged 40] [--summary-interval 1]

Modes (the attacks bench.adversary measures, each within what an honest peer's validation accepts):
- liar_staller: gossips a plausible poisoned summary (Bloom filter with k=1 and 88% of
  its bits set, a cached-block count that matches that fill, zero load, 10^9 tokens/s),
  then holds every inference stream it is given without answering.
- wrong_tokens_greedy: the same summary; answers every forward with wrong tokens (random
  ids), more of them than max_new_tokens, and a result whose served_by names the entry.
- wrong_tokens_sampled: the same summary; answers greedy requests honestly and sampled
  ones with plausible-looking wrong tokens: at each step the most likely token outside
  the request's top_p nucleus (at its temperature, the nucleus widened by NUCLEUS_MARGIN),
  i.e. a token honest sampling never draws, while the text still looks like the model's.
- sampled_steerer: the same summary; answers greedy requests honestly and sampled ones
  with plausible tokens of its own seed-free choosing (bench/rogues/sampled_steerer.py).
- forged_origins: serves honestly under its own identity, and publishes valid signed
  summaries (attractive ones, as above) of --forged fresh identities that never connect.
- sybil: --identities peers in this one process (one shared engine), each connected and
  advertising the attractive summary, each answering like wrong_tokens_greedy.
- punch_scanner, reachability_liar: serve honestly and attack the network layer
  (hole-punch Connects naming loopback ports; lying dial-back answers): bench/rogues/.
- magnet_staller: speed claims that escape naive caps, honest until past probation, then
  stalls every stream (bench/rogues/magnet_staller.py).
- relay_impersonator: serves honestly, and its relay logs, rewrites and impersonates
  (bench/rogues/relay_impersonator.py).
- probation_launderer: its own, honest summary (modest speeds, so no claim gives it
  away); passes probation by forwarding its shadows to an honest peer, then lies,
  signing everything (bench/rogues/probation_launderer.py).
- freeloader: 8 honest-looking identities, each streaming long requests at the first
  bootstrap peer, one after another (bench/rogues/freeloader.py).
- table_filler: serves honestly; 256 ghost identities' signed summaries kept fresh and
  1,024 fake providers in every GET_PROVIDERS answer (bench/rogues/table_filler.py).

This is a bench tool: production code carries no attack mode. It changes a running
`Peer` from the outside (its gossip publisher and its inference stream handler).

Reports JSON lines on stdout: {"event": "up", "peer_ids", "multiaddrs", "forged_ids"},
then every 0.5 s {"event": "stats", "received": {peer_id: forwarded requests received},
"answered": {kind: count}}. SIGTERM or stdin closing stop it.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import functools
import json
import logging
import math
import os
import random
import signal
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from bench.rogues import freeloader, probation_launderer, punch_scanner, reachability_liar
from bench.rogues.lies import forged_message, out_of_nucleus, poisoned_summary, wrong_tokens
from peer.config import PeerConfig
from peer.engine.compute_thread import compute_thread
from peer.engine.model import DTYPES
from peer.net.wire import FrameStream, StreamBroken
from peer.node import Peer, open_peer
from protocols.answers import signed_bytes
from protocols.errors import RemoteProtocolError
from protocols.ids import INFER_PROTOCOL, gossip_topic
from protocols.infer import (
    FinishReason,
    InferRequest,
    InferResult,
    TokenChunk,
    parse_request,
)
from protocols.summary import encode_summary

logger = logging.getLogger("bench.rogue")

STALL_MAX_S = 600.0  # a stalled stream is held at most this long (or the request's deadline)
READ_TIMEOUT_S = 10.0  # the entry peer sends its request at once
STATS_INTERVAL_S = 0.5
MAX_IDENTITIES = 32  # each identity is a full libp2p host in this process
MAX_FORGED = 64


class Mode(enum.Enum):
    LIAR_STALLER = "liar_staller"
    WRONG_TOKENS_GREEDY = "wrong_tokens_greedy"
    WRONG_TOKENS_SAMPLED = "wrong_tokens_sampled"
    FORGED_ORIGINS = "forged_origins"
    SYBIL = "sybil"
    PUNCH_SCANNER = "punch_scanner"  # bench/rogues/punch_scanner.py
    REACHABILITY_LIAR = "reachability_liar"  # bench/rogues/reachability_liar.py
    MAGNET_STALLER = "magnet_staller"
    RELAY_IMPERSONATOR = "relay_impersonator"  # bench/rogues/relay_impersonator.py
    FREELOADER = "freeloader"
    PROBATION_LAUNDERER = "probation_launderer"
    SAMPLED_STEERER = "sampled_steerer"
    TABLE_FILLER = "table_filler"


SURFACE_ATTACKS = {Mode.PUNCH_SCANNER: punch_scanner, Mode.REACHABILITY_LIAR: reachability_liar}
ATTRACTIVE_MODES = frozenset(
    {Mode.LIAR_STALLER, Mode.WRONG_TOKENS_GREEDY, Mode.WRONG_TOKENS_SAMPLED, Mode.SYBIL,
     Mode.SAMPLED_STEERER}
)


# -- the shell -----------------------------------------------------------------------------


class Rogue:
    """The misbehaviour installed on one or more running peers sharing one engine."""

    def __init__(self, mode: Mode, engine: Any, rng: random.Random) -> None:
        self.mode = mode
        self.engine = engine
        self.rng = rng
        self.received: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.keys: dict[str, Any] = {}  # each identity's private key: it signs its lies
        self.seen: Counter[str] = Counter()  # probation_launderer: requests per entry

    def install(self, peer: Peer) -> None:
        self.keys[peer.peer_id] = peer.host.libp2p.get_private_key()
        if self.mode in SURFACE_ATTACKS:  # serves honestly; attacks the network layer
            SURFACE_ATTACKS[self.mode].install(peer, self.answered)
            return
        if self.mode is Mode.MAGNET_STALLER:
            from bench.rogues import magnet_staller

            magnet_staller.install(peer, self.received, self.answered)
            return
        if self.mode in ATTRACTIVE_MODES:
            self._poison_gossip(peer)
        if self.mode not in (Mode.FORGED_ORIGINS, Mode.RELAY_IMPERSONATOR,
                             Mode.TABLE_FILLER):
            self._take_inference(peer)

    # gossip: publish the poisoned summary instead of the true one
    def _poison_gossip(self, peer: Peer) -> None:
        rogue = self

        async def _publish(gossip: Any, *, early: bool) -> None:
            gossip._seq += 1
            summary = poisoned_summary(
                gossip._peer_id_str, rogue.engine.model_id, rogue.engine.block_size,
                gossip._seq, rogue.rng,
            )
            with trio.move_on_after(5.0):
                await gossip._pubsub.publish(gossip._topic, encode_summary(summary))
                gossip._stats["published"] += 1

        peer.gossip._publish = types.MethodType(_publish, peer.gossip)  # type: ignore[method-assign]

    # inference: our own handler replaces the honest InferenceService's
    def _take_inference(self, peer: Peer) -> None:
        assert peer.serving is not None
        honest = peer.serving.inference.handle_stream
        self_id = peer.peer_id

        async def handle(stream: Any) -> None:
            remote = stream.muxed_conn.peer_id.to_base58()
            self.received[self_id] += 1
            if self.mode in (Mode.WRONG_TOKENS_SAMPLED, Mode.SAMPLED_STEERER):
                peer.start_soon(self._sampled_or_honest, stream, self_id, honest)
            elif self.mode is Mode.PROBATION_LAUNDERER:
                peer.start_soon(self._launder, peer, stream, remote)
            else:
                peer.start_soon(self._misbehave, stream, remote, self_id)

        peer.host.libp2p.set_stream_handler(INFER_PROTOCOL, handle)

    async def _launder(self, peer: Peer, stream: Any, remote: str) -> None:
        frames = FrameStream(stream)
        try:
            request = await self._read_request(frames)
            if request is None:
                return
            key = self.keys[peer.peer_id]

            def sign(req: InferRequest, tokens: list[int], finish: FinishReason) -> bytes:
                return bytes(key.sign(signed_bytes(peer.peer_id, req, tokens, finish)))

            with contextlib.suppress(StreamBroken), trio.move_on_after(60):
                await probation_launderer.launder(
                    peer, frames, request, remote, self.engine, self.seen, self.answered,
                    sign, self.rng,
                )
        finally:
            await frames.close()

    async def _read_request(self, frames: Any) -> InferRequest | None:
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                return parse_request(await frames.receive(), self.engine.vocab_size)
        except (RemoteProtocolError, StreamBroken, trio.TooSlowError):
            return None

    async def _misbehave(self, stream: Any, remote: str, self_id: str = "") -> None:
        """Stall, or answer wrong tokens with a result claiming the entry served them."""
        frames = FrameStream(stream)
        try:
            request = await self._read_request(frames)
            if request is None:
                return
            if self.mode is Mode.LIAR_STALLER:
                self.answered["stalled"] += 1
                await trio.sleep(min(STALL_MAX_S, request.deadline_s))
                return
            tokens = wrong_tokens(request, self.engine.vocab_size, self.rng)
            with contextlib.suppress(StreamBroken), trio.move_on_after(30):
                await self._send_tokens(
                    frames, request, tokens, served_by=remote, signer=self_id
                )
                self.answered["wrong_greedy"] += 1
        finally:
            await frames.close()

    async def _send_tokens(
        self, frames: Any, request: InferRequest, tokens: list[int], served_by: str,
        signer: str,
    ) -> None:
        for token in tokens:
            await frames.send(TokenChunk((token,), self.engine.decode([token])))
        await frames.send(
            InferResult(
                prompt_tokens=len(request.prompt_token_ids),
                cached_tokens=len(request.prompt_token_ids),
                completion_tokens=len(tokens),
                ttft_s=0.001,
                decode_tokens_per_s=1e6,
                total_s=0.01,
                finish_reason=FinishReason.LENGTH,
                served_by=served_by,
                signature=self._sign(signer, request, tokens),
            )
        )

    def _sign(self, signer: str, request: InferRequest, tokens: list[int]) -> bytes:
        """The identity's own signature over its answer (a rogue signs as peers do)."""
        key = self.keys.get(signer)
        if key is None:
            return b""
        return bytes(key.sign(signed_bytes(signer, request, tokens, FinishReason.LENGTH)))

    async def _sampled_or_honest(self, stream: Any, self_id: str, honest: Any) -> None:
        """Greedy requests go to the honest service (the rogue looks fine on them)."""
        frames = _Replay(stream)
        request = await self._read_request(FrameStream(frames))
        if request is None:
            await FrameStream(stream).close()
            return
        if request.temperature == 0.0:
            self.answered["honest_greedy"] += 1
            frames.replay()
            await honest(frames)  # replays the request bytes it already read
            return
        out = FrameStream(stream)
        try:
            if self.mode is Mode.SAMPLED_STEERER:
                from bench.rogues.sampled_steerer import steered_tokens

                tokens = await steered_tokens(self.engine, request, self.rng)
            else:
                tokens = await self._implausible(request)
            with contextlib.suppress(StreamBroken), trio.move_on_after(30):
                await self._send_tokens(out, request, tokens, served_by=self_id, signer=self_id)
                self.answered["wrong_sampled"] += 1
        finally:
            await out.close()

    async def _implausible(self, request: InferRequest) -> list[int]:
        engine = self.engine

        def run() -> list[int]:
            runner = engine.runner  # the engine's own model runner
            kv = runner.new_kv([], len(request.prompt_token_ids) + request.max_new_tokens)
            logits = runner.forward([(kv, list(request.prompt_token_ids))], [True])[0]
            out: list[int] = []
            for _ in range(request.max_new_tokens):
                token = out_of_nucleus(logits, request.temperature, request.top_p)
                out.append(token)
                logits = runner.forward([(kv, [token])], [True])[0]
            return out

        async with engine.model_lock:  # never while a batch step runs the model
            tokens: list[int] = await compute_thread().run(run)
        return tokens


class _Replay:
    """A stream whose first reads replay the bytes already read (to hand a request on)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._seen = bytearray()
        self._replaying = False
        self.muxed_conn = stream.muxed_conn

    async def read(self, n: int | None = None) -> bytes:
        if self._replaying and self._seen:
            data = bytes(self._seen)
            self._seen.clear()
            return data
        data: bytes = await self._stream.read(n)
        if not self._replaying:
            self._seen += data
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def replay(self) -> None:
        self._replaying = True


async def _forge_loop(
    peer: Peer, engine: Any, keys: list[Any], interval_s: float, rng: random.Random
) -> None:
    """Publish attractive summaries of the identities of `keys`, every interval, forever."""
    topic = gossip_topic(engine.model_id)
    origins = [ID.from_pubkey(k.public_key).to_base58() for k in keys]
    seq = 0
    while True:
        seq += 1
        for key, origin in zip(keys, origins, strict=True):
            summary = poisoned_summary(origin, engine.model_id, engine.block_size, seq, rng)
            msg = forged_message(key, topic, encode_summary(summary), rng)
            with trio.move_on_after(5.0):
                await peer.pubsub.push_msg(peer.pubsub.my_id, msg)
        await trio.sleep(interval_s)


async def run(args: argparse.Namespace) -> None:
    from peer.engine.engine import load_engine

    mode = Mode(args.mode)
    rng = random.Random(args.seed)
    engine = await compute_thread().run(
        functools.partial(load_engine, args.model, args.cache_bytes, 16, dtype=args.dtype)
    )
    rogue = Rogue(mode, engine, rng)
    identities = args.identities if mode is Mode.SYBIL else 1
    if mode is Mode.FREELOADER:
        identities = freeloader.IDENTITIES
    config = PeerConfig(
        model=args.model, listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap=tuple(args.bootstrap),
        identity_file=None, cache_bytes=args.cache_bytes, summary_interval_s=args.summary_interval,
    )
    forged_ids: list[str] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery, contextlib.AsyncExitStack() as stack:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            async def stop_on_stdin() -> None:
                while await trio.to_thread.run_sync(  # type: ignore[call-arg]
                    sys.stdin.buffer.readline, abandon_on_cancel=True
                ):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            nursery.start_soon(stop_on_stdin)
            peers: list[Any] = []
            if mode is Mode.FREELOADER:  # strangers who want compute need no peer
                peers = [
                    await stack.enter_async_context(freeloader.open_client(config))
                    for _ in range(identities)
                ]
            else:
                peers = [
                    await stack.enter_async_context(open_peer(config, engine=engine))
                    for _ in range(identities)
                ]
                for peer in peers:
                    rogue.install(peer)
            relay = None
            if mode is Mode.RELAY_IMPERSONATOR:
                from bench.rogues import relay_impersonator

                relay = relay_impersonator.install(peers[0], Path(args.relay_dump))
            if mode is Mode.FORGED_ORIGINS:
                keys = [create_new_key_pair(rng.randbytes(32)) for _ in range(args.forged)]
                forged_ids = [ID.from_pubkey(k.public_key).to_base58() for k in keys]
                nursery.start_soon(
                    _forge_loop, peers[0], engine, keys, args.summary_interval, rng
                )
            if mode is Mode.FREELOADER:
                for i, peer in enumerate(peers):
                    nursery.start_soon(
                        freeloader.freeload, peer, args.bootstrap[0], engine.vocab_size,
                        rogue.answered, random.Random(args.seed + i), i * freeloader.STAGGER_S,
                    )
            if mode is Mode.TABLE_FILLER:
                from bench.rogues import table_filler

                forged_ids = table_filler.install(peers[0], engine, rng, rogue.answered)
            _emit({
                "event": "up", "pid": os.getpid(), "mode": mode.value,
                "peer_ids": [p.peer_id for p in peers],
                "multiaddrs": [p.multiaddrs for p in peers], "forged_ids": forged_ids,
            })
            while True:
                _emit({"event": "stats", "received": dict(rogue.received),
                       "answered": dict(rogue.answered),
                       **({"relay": relay.report()} if relay is not None else {})})
                await trio.sleep(STATS_INTERVAL_S)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.rogue", description=__doc__.split("\n")[0])
    p.add_argument("--mode", required=True, choices=[m.value for m in Mode])
    p.add_argument("--bootstrap", nargs="+", default=[], metavar="MULTIADDR")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the weight format (the model id names it: peers on another one "
                        "are another swarm)")
    p.add_argument("--cache-bytes", type=int, default=1_000_000)
    p.add_argument("--identities", type=int, default=10, help="sybil: peers in this process")
    p.add_argument("--forged", type=int, default=40, help="forged_origins: fresh identities")
    p.add_argument("--summary-interval", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--relay-dump", default="/tmp/relay_impersonator",
                   help="relay_impersonator: every forwarded byte goes under this directory")
    p.add_argument("--log-level", default="ERROR")
    args = p.parse_args(argv)
    if not 1 <= args.identities <= MAX_IDENTITIES:
        p.error(f"--identities must be in [1, {MAX_IDENTITIES}]")
    if not 1 <= args.forged <= MAX_FORGED:
        p.error(f"--forged must be in [1, {MAX_FORGED}]")
    if not math.isfinite(args.summary_interval) or args.summary_interval <= 0:
        p.error("--summary-interval must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trio.run(run, args)


if __name__ == "__main__":
    main()
