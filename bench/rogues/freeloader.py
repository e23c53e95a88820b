"""freeloader: stranger identities that stream long requests at one honest peer.

Each identity is a bare libp2p host of the rogue process (`open_client`: no gossip, DHT
or discovery, as a stranger who only wants compute runs; eight whole peers in one
process spent the shared test machine's CPU and starved their own streams). It asks the
target peer, over the inference protocol, for one long completion after another: a
prompt of PROMPT_TOKENS random token ids (never cached) and ANSWER_TOKENS to generate,
one stream at a time, as fast as the target answers. A refusal is honoured as a patient
client would (it waits the retry time the error names, or RETRY_S). What each identity
got is counted by outcome ("served", or the error code) for the bench's row.
"""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.net.host import SwarmHost, open_host
from peer.net.wire import FrameStream
from protocols.ids import INFER_PROTOCOL
from protocols.infer import InferError, InferRequest, InferResult, parse_response

IDENTITIES = 8  # stranger identities, one stream each
PROMPT_TOKENS = 1_900  # with ANSWER_TOKENS: ~2,000 tokens, inside tiny-random's context
ANSWER_TOKENS = 100
DEADLINE_S = 60.0
STREAM_TIMEOUT_S = 20.0  # this process runs 8 hosts on a loaded machine
STAGGER_S = 1.0  # identity i starts after i of these: eight dials at once time out here
RETRY_S = 1.0  # after a refusal that names no retry time, or a broken stream
MAX_RETRY_S = 10.0
logger = logging.getLogger("bench.rogue")
_RETRY_AFTER = re.compile(r"retry after ([0-9.]+) s")


@dataclass(frozen=True)
class Client:
    """One stranger identity: a host that dials and streams, and nothing else."""

    host: SwarmHost

    @property
    def peer_id(self) -> str:
        return self.host.peer_id.to_base58()

    @property
    def multiaddrs(self) -> list[str]:
        return self.host.multiaddrs


@asynccontextmanager
async def open_client(config: PeerConfig) -> AsyncIterator[Client]:
    """A bare host on ``config``'s listen addresses, with a fresh identity."""
    async with open_host(config) as host:
        yield Client(host)


def target_of(bootstrap: str) -> ID:
    """The peer id at the end of a bootstrap multiaddr (/.../p2p/<id>)."""
    return ID.from_base58(bootstrap.rsplit("/p2p/", 1)[1])


def retry_after(error: InferError) -> float:
    found = _RETRY_AFTER.search(error.message)
    return min(MAX_RETRY_S, float(found.group(1))) if found else RETRY_S


async def freeload(
    peer: Any, bootstrap: str, vocab_size: int, outcomes: Counter[str], rng: random.Random,
    start_after_s: float = 0.0,
) -> None:
    """Forever: one long request at a time from `peer`'s identity to the peer at
    `bootstrap` (dialled first, again whenever the connection is gone)."""
    await trio.sleep(start_after_s)
    target = target_of(bootstrap)
    n = 0
    while True:
        if not peer.host.is_connected(target):
            try:
                await peer.host.connect(bootstrap, timeout_s=STREAM_TIMEOUT_S)
            except Exception as exc:  # the dial failed: try again later
                outcomes[f"dial failed: {type(exc).__name__}"] += 1
                await trio.sleep(RETRY_S)
                continue
        n += 1
        request = InferRequest(
            request_id=f"{peer.peer_id[-8:]}-{n}",
            prompt_token_ids=tuple(rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS)),
            max_new_tokens=ANSWER_TOKENS,
            deadline_s=DEADLINE_S,
            hops=1,
        )
        wait = await _one(peer, target, request, vocab_size, outcomes)
        await trio.sleep(wait)


async def _one(
    peer: Any, target: ID, request: InferRequest, vocab_size: int, outcomes: Counter[str]
) -> float:
    """Send one request and read its stream to the end; the seconds to wait after it."""
    try:
        with trio.fail_after(DEADLINE_S):
            stream = await peer.host.new_stream(
                target, [INFER_PROTOCOL], timeout_s=STREAM_TIMEOUT_S
            )
            frames = FrameStream(stream)
            try:
                await frames.send(request)
                while True:
                    frame = parse_response(await frames.receive(), vocab_size)
                    if isinstance(frame, InferResult):
                        outcomes["served"] += 1
                        return 0.0
                    if isinstance(frame, InferError):
                        outcomes[frame.code.value] += 1
                        return retry_after(frame)
            finally:
                await frames.close()
    except Exception as exc:  # a dial failed, say: the rogue goes on
        outcomes[f"broken: {type(exc).__name__}"] += 1
        logger.error("freeloader %s: %s: %s", peer.peer_id[-8:], type(exc).__name__, exc)
        return RETRY_S
