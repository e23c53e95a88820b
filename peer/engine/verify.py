"""Teacher-forced verification of another peer's output.

One forward over prompt + output (a prefill, not a decode loop) gives the model's
distribution at every output position; each token is then checked against it:

  greedy (temperature 0)  the token is the argmax, or within GREEDY_MAX_LOGPROB_GAP of it
  sampled, seeded         the token is the one the seed selects (sampling.py's Gumbel-max
                          sampler): its perturbed score logit + T * gumbel(seed, position)
                          is within SEEDED_MAX_SCORE_GAP of the best perturbed score in
                          the top_p nucleus, and it lies in the nucleus (up to
                          NUCLEUS_TOLERANCE either way at the cut)
  sampled, no seed        (only a caller outside the swarm: the entry seeds every sampled
                          request) the token lies in the nucleus and its probability is
                          at least SAMPLED_MIN_LOGPROB: a statistical check, far weaker
  structure               no more than max_new_tokens tokens, ids inside the vocabulary,
                          nothing after an end-of-sequence token, and a stop string only
                          at the end (a shorter answer must end at EOS or a stop string)

The checks need logits but no engine. verify_output drives them for Engine.verify through
the engine's public members (VerifyingEngine): the forward runs over the prompt's cached
prefix in worker-thread chunks outside the batch, each holding the engine's model lock, so
batch steps run between chunks, never during one. Verification reads the cache and never
writes it: what an entry verified must not show in its next summary (a serving peer would
learn which of its answers were checked).
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import trio

from protocols.ids import split_model_id

from .api import EngineError, SamplingParams, Verdict
from .compute_thread import compute_thread
from .radix import RadixCache
from .runner import Runner, SeqKV
from .sampling import NOISE_ROWS, nucleus_masks, perturbed_scores
from .verify_plan import verify_chunks

__all__ = [
    "BF16_LOGITS_GAP",
    "BF16_LOGIT_FORMATS",
    "DEFAULT_TOLERANCE",
    "Finding",
    "Tolerance",
    "Verdict",
    "VerifyingEngine",
    "accepted_fraction",
    "check_logits",
    "check_structure",
    "forward_chunk",
    "greedy_gaps",
    "score_chunk",
    "seeded_gaps",
    "tolerance",
    "verify_output",
]

# Hardware, kernels, batch shapes and dtypes change logits in the last bits (fp32 ~1e-5),
# so two honest peers can pick different argmaxes at a near tie. A token this close to the
# best one is accepted: a liar gains nothing by choosing among near-equal tokens.
GREEDY_MAX_LOGPROB_GAP = 0.1
# Where the logits themselves are bfloat16 they are spaced 0.125 apart between 16 and 32 and
# 0.25 between 32 and 64 (8 significant bits), and the teacher-forced prefill rounds them
# differently from the decode steps, the prefix cache's chunks and the batch that produced
# the answer: `python -m bench.greedy_gaps` measured honest SmolLM2 tokens up to 0.25 below
# the verifier's argmax in bfloat16, int8 and int4 (60 answers each, workload seed 0), so 5-7
# of 60 honest answers failed the 0.1 check. Twice the largest gap measured. The seeded
# check gets the same in these formats: `bench.sampling` measured honest int4 perturbed
# scores up to 0.24 below the seed's token (one sampled answer in 8 failed 0.1).
BF16_LOGITS_GAP = 0.5
BF16_LOGIT_FORMATS = frozenset({"bfloat16", "int8", "int4"})
# The same numerical slack for a seeded sampled token, in the same logit units: its
# perturbed score (logit + T * gumbel) may sit this far below the best one. Measured by
# `python -m bench.sampling` across batch shapes and dtypes (docs/security.md): honest
# tokens sat 0 below in float32, up to 0.076 in bfloat16 and 0.095 in int8 (bf16
# activations): close to this bound, which the greedy check shares.
SEEDED_MAX_SCORE_GAP = 0.1


class Tolerance(NamedTuple):
    """How far an honest token may sit below the best one: greedy in log-probability,
    seeded in perturbed score (logit units)."""

    greedy: float
    seeded: float


DEFAULT_TOLERANCE = Tolerance(GREEDY_MAX_LOGPROB_GAP, SEEDED_MAX_SCORE_GAP)
# A sampled token's log-probability must be at least this (prob 1e-9). An honest sampler
# draws tokens below it with total probability at most vocab x 1e-9 (5e-5 per token for a
# 49k vocabulary, in the worst case of every other token sitting just below it), while
# tokens a language model deems nonsense sit tens of nats lower.
SAMPLED_MIN_LOGPROB = math.log(1e-9)
# top_p cuts the sorted distribution at a cumulative mass; small logit differences move
# that mass slightly, so the cut is widened by this much.
NUCLEUS_TOLERANCE = 0.01


class VerifyingEngine(Protocol):
    """What verification uses of an engine (engine.py's Engine): public members only."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def cache(self) -> RadixCache[torch.Tensor]: ...
    @property
    def runner(self) -> Runner: ...
    @property
    def model_lock(self) -> trio.Lock: ...
    @property
    def model_id(self) -> str: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Finding:
    """A failed check: where and why."""

    index: int
    detail: str


def check_structure(
    output_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    eos_ids: Collection[int],
    decode: Callable[[Sequence[int]], str],
) -> Finding | None:
    """Checks that need no logits: length, vocabulary, EOS and stop-string positions."""
    if not output_ids:
        return Finding(0, "the output is empty (at least one token is always generated)")
    for i, tok in enumerate(output_ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            return Finding(i, f"token {tok!r} is outside the vocabulary [0, {vocab_size})")
    if len(output_ids) > params.max_new_tokens:
        return Finding(
            params.max_new_tokens,
            f"{len(output_ids)} tokens exceed max_new_tokens={params.max_new_tokens}",
        )
    for i, tok in enumerate(output_ids[:-1]):
        if tok in eos_ids:
            return Finding(i + 1, f"tokens follow the end-of-sequence token at {i}")
    if params.stop:
        for end in range(1, len(output_ids)):
            text = decode(output_ids[:end])
            hit = next((s for s in params.stop if s in text), None)
            if hit is not None:
                return Finding(end, f"tokens follow stop string {hit!r}")
    ended = output_ids[-1] in eos_ids or (
        bool(params.stop) and any(s in decode(output_ids) for s in params.stop)
    )
    if len(output_ids) < params.max_new_tokens and not ended:
        return Finding(
            len(output_ids),
            f"the output stops after {len(output_ids)} of {params.max_new_tokens} tokens "
            "without an end-of-sequence token or a stop string",
        )
    return None


def check_logits(
    logits: torch.Tensor, output_ids: Sequence[int], params: SamplingParams, offset: int = 0,
    prompt_tokens: int = 0, slack: Tolerance | None = None,
) -> Finding | None:
    """Check output_ids[offset:offset + rows] against `logits` [rows, vocab], where row r
    is the model's prediction for output token offset + r (at position prompt_tokens +
    offset + r of prompt + output: the seeded sampler's key), within ``slack`` (the
    format's `tolerance`; DEFAULT_TOLERANCE if None). The first failure, or None."""
    slack = slack or DEFAULT_TOLERANCE
    rows = logits.shape[0]
    targets = torch.tensor(list(output_ids[offset : offset + rows]), dtype=torch.long)
    if params.temperature == 0.0:
        gaps = greedy_gaps(logits, targets)
        bad = torch.nonzero(gaps > slack.greedy)
        if len(bad):
            r = int(bad[0, 0])
            return Finding(
                offset + r,
                f"token {int(targets[r])} is not the greedy choice: its log-probability is "
                f"{float(gaps[r]):.3f} below the best token {int(logits[r].argmax())} "
                f"(tolerance {slack.greedy})",
            )
        return None
    if params.seed is not None:
        for start in range(0, rows, NOISE_ROWS):
            found = _check_seeded(logits[start : start + NOISE_ROWS],
                                  targets[start : start + NOISE_ROWS], params,
                                  prompt_tokens + offset + start, slack.seeded)
            if found is not None:
                return Finding(offset + start + found.index, found.detail)
        return None
    return _check_unseeded(logits, targets, params, offset)


def greedy_gaps(logits: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` [rows, vocab], how far the target token's log-probability sits
    below the best token's (0 where the target is the argmax): the greedy check's quantity."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.as_tensor(targets, dtype=torch.long)[:, None]
    gaps: torch.Tensor = logp.max(dim=-1).values - logp.gather(1, index)[:, 0]
    return gaps


def tolerance(fmt: str) -> Tolerance:
    """The checks' slack for a weight format (a model id's format, protocols.ids):
    DEFAULT_TOLERANCE, or BF16_LOGITS_GAP for both checks where the logits are bfloat16
    (bfloat16, and int8 / int4, whose activations are bfloat16): their spacing moves a
    perturbed score as far as a log-probability."""
    if fmt in BF16_LOGIT_FORMATS:
        return Tolerance(BF16_LOGITS_GAP, BF16_LOGITS_GAP)
    return DEFAULT_TOLERANCE


def seeded_gaps(
    logits: torch.Tensor, params: SamplingParams, first_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` [rows, vocab] (row r: the token at first_position + r): how far
    each token's perturbed score sits below the best one the seed selects among (float64
    [rows, vocab], inf outside the widened nucleus), and the token the seed selects by
    these logits (the best of the nucleus itself). A token is accepted where its gap is
    at most SEEDED_MAX_SCORE_GAP."""
    assert params.seed is not None
    positions = range(first_position, first_position + logits.shape[0])
    scores = perturbed_scores(logits, params.temperature, params.seed, positions)
    cpu = logits.detach().to("cpu", torch.float32)
    exact = nucleus_masks(cpu, params.temperature, params.top_p)
    # The nucleus cut moves with the last bits of the logits: the best score is taken over
    # the nucleus narrowed by NUCLEUS_TOLERANCE, and a token may lie in the widened one.
    # At top_p 1 there is no cut: every token competes.
    if params.top_p >= 1.0:
        narrow = wide = exact
    else:
        narrow = nucleus_masks(cpu, params.temperature, params.top_p - NUCLEUS_TOLERANCE)
        wide = nucleus_masks(cpu, params.temperature, params.top_p + NUCLEUS_TOLERANCE)
    best = scores.masked_fill(~narrow, -math.inf).max(dim=-1, keepdim=True).values
    gaps = (best - scores).masked_fill(~wide, math.inf)
    chosen = scores.masked_fill(~exact, -math.inf).argmax(dim=-1)
    return gaps, chosen


def _check_seeded(
    logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams, first_position: int,
    tolerance: float = SEEDED_MAX_SCORE_GAP,
) -> Finding | None:
    gaps, chosen = seeded_gaps(logits, params, first_position)
    token_gaps = gaps.gather(1, targets[:, None])[:, 0]
    bad = torch.nonzero(token_gaps > tolerance)
    if not len(bad):
        return None
    r = int(bad[0, 0])
    gap = float(token_gaps[r])
    where = "outside the top_p nucleus" if math.isinf(gap) else f"{gap:.3f} below the best"
    return Finding(
        r,
        f"token {int(targets[r])} is not the one seed {params.seed} selects at position "
        f"{first_position + r} (token {int(chosen[r])}): its perturbed score is {where} "
        f"(tolerance {tolerance})",
    )


def _check_unseeded(
    logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams, offset: int
) -> Finding | None:
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    token_logp = logp.gather(1, targets[:, None])[:, 0]
    probs = logp.exp()
    # Mass of the tokens strictly more likely than this one: the nucleus cut a sampler
    # applies before it (ties count in the token's favour).
    above = (probs * (probs > token_logp.exp()[:, None])).sum(dim=-1)
    low = token_logp < SAMPLED_MIN_LOGPROB
    outside = above >= params.top_p + NUCLEUS_TOLERANCE
    bad = torch.nonzero(low | outside)
    if not len(bad):
        return None
    r = int(bad[0, 0])
    if bool(low[r]):
        detail = (
            f"token {int(targets[r])} has probability {math.exp(float(token_logp[r])):.3g} at "
            f"temperature {params.temperature}, below the floor "
            f"{math.exp(SAMPLED_MIN_LOGPROB):.0e}"
        )
    else:
        detail = (
            f"token {int(targets[r])} lies outside the top_p={params.top_p} nucleus (tokens "
            f"above it hold {float(above[r]):.3f} of the mass, tolerance {NUCLEUS_TOLERANCE})"
        )
    return Finding(offset + r, detail)


def accepted_fraction(
    logits: torch.Tensor, params: SamplingParams, first_position: int = 0
) -> torch.Tensor:
    """Per row of `logits` [rows, vocab] (row r: the token at first_position + r for a
    seeded request): the share of the vocabulary that check_logits would accept there,
    i.e. the chance that a uniformly random substitute passes."""
    if params.temperature == 0.0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        near = logp >= logp.max(dim=-1, keepdim=True).values - GREEDY_MAX_LOGPROB_GAP
        return near.float().mean(dim=-1)
    if params.seed is not None:
        shares = [
            (seeded_gaps(logits[i : i + NOISE_ROWS], params, first_position + i)[0]
             <= SEEDED_MAX_SCORE_GAP).float().mean(dim=-1)
            for i in range(0, logits.shape[0], NOISE_ROWS)
        ]
        return torch.cat(shares)
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    sorted_logp, _ = torch.sort(logp, dim=-1, descending=True)
    p = sorted_logp.exp()
    above = torch.cumsum(p, dim=-1) - p  # ties count against the token here: a lower bound
    ok = (above < params.top_p + NUCLEUS_TOLERANCE) & (sorted_logp >= SAMPLED_MIN_LOGPROB)
    return ok.float().mean(dim=-1)


def forward_chunk(
    runner: Runner, kv: SeqKV, full: list[int], end: int, n: int
) -> tuple[torch.Tensor, int]:
    """Worker thread: feed full[kv.length:end], where full is prompt (n tokens) + output
    but its last token. The logits of the chunk's rows that predict output tokens (none
    before the last prompt token), and the index of the first output token they predict."""
    pos = kv.length
    first = max(pos, n - 1)  # rows from the last prompt token on predict output tokens
    logits = runner.forward([(kv, full[pos:end])], [max(end - first, 0)])
    return logits, first - (n - 1)


def score_chunk(
    runner: Runner, kv: SeqKV, full: list[int], end: int, n: int, output: list[int],
    params: SamplingParams, slack: Tolerance | None = None,
) -> Finding | None:
    """Worker thread: `forward_chunk`, then check the output tokens its rows predict."""
    logits, offset = forward_chunk(runner, kv, full, end, n)
    if not logits.shape[0]:
        return None
    return check_logits(logits, output, params, offset, n, slack)


async def verify_output(
    engine: VerifyingEngine, tokens: list[int], output_ids: Sequence[int],
    params: SamplingParams, salt: bytes | None,
) -> Verdict:
    """Teacher-force `output_ids` after the validated prompt `tokens` on `engine`, over the
    prompt's cached prefix; nothing enters the cache. EngineError when torch fails."""
    start = time.perf_counter()
    try:
        output = [operator.index(t) for t in output_ids]
    except TypeError:
        return Verdict(False, 0, "output token ids must be integers", 0)
    found = await trio.to_thread.run_sync(  # stop strings decode every prefix: O(n^2)
        check_structure, output, params, engine.vocab_size, engine.eos_token_ids, engine.decode
    )
    if found is not None:
        return Verdict(False, found.index, found.detail, 0)
    n, size = len(tokens), engine.block_size
    slack = tolerance(split_model_id(engine.model_id)[1])
    full = tokens + output[:-1]  # the last output token is predicted, never fed
    max_blocks = (n - 1) // size  # the last prompt token is always fed: it predicts output[0]
    match = engine.cache.match(tokens, trio.current_time(), max_blocks, salt=salt)
    engine.cache.lock(match)
    try:
        kv: SeqKV | None = None
        for new, before in verify_chunks(n, len(output), match.num_tokens):
            async with engine.model_lock:  # no batch step meanwhile; steps between chunks
                if kv is None:
                    kv = await compute_thread().run(engine.runner.new_kv, match.values,
                                                    len(full))
                found = await compute_thread().run(
                    score_chunk, engine.runner, kv, full, before + new, n, output, params,
                    slack,
                )
            if found is not None:
                break
    except Exception as exc:  # torch failure: this verification fails, not the engine
        raise EngineError(f"verification failed: {type(exc).__name__}: {exc}") from exc
    finally:
        engine.cache.unlock(match)
    checked = len(output) if found is None else found.index + 1
    elapsed = time.perf_counter() - start
    if found is None:
        return Verdict(True, None, "verified", checked, match.num_tokens, elapsed)
    return Verdict(False, found.index, found.detail, checked, match.num_tokens, elapsed)

