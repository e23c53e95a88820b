"""sampled_steerer: steers sampled answers with plausible tokens of its own choosing.

Greedy requests it serves honestly (bench/rogue.py hands them to the honest service), so
it looks fine on them. For a sampled request it runs the model itself and at each step
takes the token that its own seed-free choice draws: a draw from the very distribution
the request asks for (same temperature and top_p, with peer/engine/sampling.py's own
sampler) but under a seed of its choosing, not the request's. Every such token is
plausible (most are among the most likely few), and no statistical test of one answer can
tell it from honest sampling; only the seed's exact token can. bench/rogue.py also gives
it the attractive poisoned summary, so entries want to route to it.
"""

from __future__ import annotations

import random
from typing import Any

import trio

from peer.engine.sampling import sample_seeded
from protocols.infer import InferRequest


async def steered_tokens(engine: Any, request: InferRequest, rng: random.Random) -> list[int]:
    """The answer the steerer sends: its own draws, as many as asked for (up to an EOS)."""
    own_seed = rng.getrandbits(63)
    prompt = list(request.prompt_token_ids)

    def run() -> list[int]:
        runner = engine.runner  # the engine's own model runner
        kv = runner.new_kv([], len(prompt) + request.max_new_tokens)
        logits = runner.forward([(kv, prompt)], [True])[0]
        out: list[int] = []
        while len(out) < request.max_new_tokens:
            token = sample_seeded(logits, request.temperature, request.top_p, own_seed,
                                  len(prompt) + len(out))
            out.append(token)
            if token in engine.eos_token_ids or len(out) == request.max_new_tokens:
                break
            logits = runner.forward([(kv, [token])], [True])[0]
        return out

    async with engine.model_lock:  # never while a batch step runs the model
        tokens: list[int] = await trio.to_thread.run_sync(run)
    return tokens
