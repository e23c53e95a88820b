"""probation_launderer: passes probation on answers it obtains from an honest peer, then lies.

For each entry peer, the first PROBATION_ANSWERS requests it receives (the shadows of
its probation) are forwarded to an honest peer of the swarm, whose answer it relays as
its own and signs with its own key. Every later request is answered the same way but
with its first token replaced by the model's least likely one (a lie every verifier
rejects), signed too: the rogue behaves as a careful liar would, never caught by the
protocol's structure, only by re-scoring. Counts: "proxied", "lied", "refused" (the
honest peer would not serve it), "failed".
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from peer.net.wire import FrameStream, StreamBroken
from protocols.errors import RemoteProtocolError
from protocols.ids import INFER_PROTOCOL
from protocols.infer import (
    FinishReason,
    InferError,
    InferRequest,
    InferResult,
    TokenChunk,
    parse_response,
)

PROBATION_ANSWERS = 3  # peer.routing.trust.DEFAULT_PROBATION_REQUESTS
PROXY_TIMEOUT_S = 30.0

Sign = Callable[[InferRequest, list[int], FinishReason], bytes]


async def proxied_answer(
    peer: Any, honest: str, request: InferRequest, vocab_size: int, rng: random.Random
) -> tuple[list[int], InferResult] | InferError | None:
    """The honest peer's answer to the same request under a fresh id (None: broken)."""
    ask = InferRequest(
        request_id=f"{rng.getrandbits(64):016x}", prompt_token_ids=request.prompt_token_ids,
        max_new_tokens=request.max_new_tokens, deadline_s=min(request.deadline_s,
                                                               PROXY_TIMEOUT_S),
        temperature=request.temperature, top_p=request.top_p, seed=request.seed,
        stop=request.stop, hops=1,
    )
    tokens: list[int] = []
    with trio.move_on_after(PROXY_TIMEOUT_S):
        try:
            frames = FrameStream(await peer.host.new_stream(ID.from_base58(honest),
                                                            [INFER_PROTOCOL]))
        except Exception:  # unreachable: the caller counts it
            return None
        try:
            await frames.send(ask)
            while True:
                frame = parse_response(await frames.receive(), vocab_size)
                if isinstance(frame, TokenChunk):
                    tokens.extend(frame.token_ids)
                elif isinstance(frame, InferResult):
                    return tokens, frame
                else:
                    return frame
        except (StreamBroken, RemoteProtocolError):
            return None
        finally:
            with contextlib.suppress(StreamBroken):
                await frames.close()
    return None


def least_likely_first(engine: Any, request: InferRequest) -> int:
    """The token the model ranks last after the prompt (blocking: run it in a thread)."""
    import torch

    runner = engine.runner
    kv = runner.new_kv([], len(request.prompt_token_ids) + 1)
    logits = runner.forward([(kv, list(request.prompt_token_ids))], [True])[0]
    return int(torch.argmin(logits.float()))


async def launder(
    peer: Any, frames: Any, request: InferRequest, entry: str, engine: Any,
    seen: Counter[str], counts: Counter[str], sign: Sign, rng: random.Random,
) -> None:
    """Answer `request` from `entry` with an honest peer's answer, corrupted once the
    entry has had its PROBATION_ANSWERS."""
    now = trio.current_time()
    honest = [
        v.peer_id for v in peer.table.views(now) if v.peer_id not in (entry, peer.peer_id)
    ]
    if not honest:
        counts["failed"] += 1
        return
    seen[entry] += 1
    got = await proxied_answer(peer, rng.choice(honest), request, engine.vocab_size, rng)
    if got is None:
        counts["failed"] += 1
        return
    if isinstance(got, InferError):
        counts["refused"] += 1
        await frames.send(got)
        return
    tokens, result = got
    lie = seen[entry] > PROBATION_ANSWERS and bool(tokens)
    if lie:
        async with engine.model_lock:
            tokens[0] = await trio.to_thread.run_sync(least_likely_first, engine, request)
    for token in tokens:
        await frames.send(TokenChunk((token,), engine.decode([token])))
    await frames.send(InferResult(
        prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens,
        completion_tokens=len(tokens), ttft_s=result.ttft_s,
        decode_tokens_per_s=result.decode_tokens_per_s, total_s=result.total_s,
        finish_reason=result.finish_reason, served_by=peer.peer_id,
        signature=sign(request, tokens, result.finish_reason),
    ))
    counts["lied" if lie else "proxied"] += 1
