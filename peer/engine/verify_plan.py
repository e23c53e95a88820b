"""How a verification's forward is cut into chunks (pure): what it costs the verifier.

A re-score feeds the prompt and all but the last output token (the last is predicted,
never fed) over the prompt's cached prefix, VERIFY_CHUNK_TOKENS at a time, each chunk a
forward of its own between batch steps (verify.py `verify_output`). The simulator prices
an entry's verifications and audits with the same chunks.
"""

from __future__ import annotations

__all__ = ["VERIFY_CHUNK_TOKENS", "verify_chunks"]

# Rows of logits computed per forward chunk: bounds the logits tensor (256 x 49k fp32 =
# 50 MB for SmolLM2) and is the grain at which a verification yields to other requests.
VERIFY_CHUNK_TOKENS = 256


def verify_chunks(prompt_tokens: int, output_tokens: int, cached_tokens: int,
                  chunk_tokens: int = VERIFY_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """(new tokens, tokens before them) of each forward that re-scores `output_tokens`
    after a prompt of `prompt_tokens`, `cached_tokens` of it cached."""
    if min(prompt_tokens, output_tokens, cached_tokens) < 0 or chunk_tokens < 1:
        raise ValueError("token counts must be >= 0 and chunk_tokens >= 1")
    if cached_tokens >= prompt_tokens and prompt_tokens > 0:
        raise ValueError("the last prompt token is always fed: cached_tokens < prompt_tokens")
    fed = prompt_tokens + max(0, output_tokens - 1)
    chunks, at = [], cached_tokens
    while at < fed:
        n = min(chunk_tokens, fed - at)
        chunks.append((n, at))
        at += n
    return chunks
