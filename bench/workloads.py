"""Workloads for the benchmarks: token-level serving workloads built from real MMLU.

The MMLU questions and their 5-shot prompts come from peer.demo_data (the demo uses the
same loader); this module splits them into shared prefixes and unique suffixes, tokenizes
them and draws seeded request streams (Zipf popularity, Poisson arrivals) from them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.demo_data import (
    CHOICE_LETTERS,
    NUM_SHOTS,
    MmluQuestion,
    by_subject,
    five_shot_header,
    five_shot_prompt,
    format_question,
    load_mmlu,
    mmlu_path,
)

# -- token-level serving workloads (the simulator's input) ------------------------------
#
# The simulator works on token ids: the radix tree and the block hashes run on them.
# Prompts are built from real MMLU text and tokenized with the real SmolLM2 tokenizer;
# the token ids are cached on disk (tokenizing 14k prompts takes ~15 s with loading).

MMLU_TOKENS_FORMAT = 1  # bump when the prompt text or the cache layout changes
MMLU_TOKENS_FILE = f"mmlu-smollm2-tokens-v{MMLU_TOKENS_FORMAT}.json"
MAX_WORKLOAD_REQUESTS = 10_000_000  # bounds memory of a generated workload (~100 B/request)
CHAT_MARKERS = {  # SmolLM2's chat template (ChatML): role headers and the turn end
    "system": "<|im_start|>system\n",
    "user": "<|im_start|>user\n",
    "assistant": "<|im_start|>assistant\n",
    "end": "<|im_end|>\n",
}


@dataclass(frozen=True)
class TokenRequest:
    """One request of a token-level workload: prompt = prefix + suffix.

    Requests with the same `prefix_key` share the very same `prefix` tuple (the simulator
    hashes a shared prefix once). `output` is what the model is taken to answer (cached
    afterwards only when the engine caches generated tokens).
    """

    arrival_s: float
    prefix_key: int
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    max_new_tokens: int
    group: int = 0  # subject, conversation or system-prompt group
    output: tuple[int, ...] = ()
    turn: int = 0  # multi-turn workloads: 0 for a conversation's first turn, then 1, 2, ...

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix) + len(self.suffix)


def poisson_arrivals(rng: random.Random, n: int, rate_per_s: float) -> list[float]:
    """`n` arrival times of a Poisson process of `rate_per_s`, starting near 0."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised Zipf weights 1/k^s for ranks k = 1..n (s = 0 is uniform)."""
    if n < 1 or s < 0:
        raise ValueError(f"need n >= 1 and s >= 0, got n={n}, s={s}")
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True)
class TokenizedMMLU:
    """5-shot MMLU prompts as token ids: one shared prefix per subject, one suffix per question.

    tokens(prefix) + tokens(suffix) equals tokens(prefix + suffix) (the cut is placed
    before the "\\n\\n" that precedes the question, where the tokenizer's pre-tokenizer
    splits anyway; test_workloads checks it on real prompts when the tokenizer is there).
    """

    tokenizer: str
    subjects: tuple[str, ...]
    prefixes: tuple[tuple[int, ...], ...]
    questions: tuple[tuple[tuple[int, ...], ...], ...]
    answers: tuple[tuple[tuple[int, ...], ...], ...]  # " B" etc.: the expected reply
    markers: dict[str, tuple[int, ...]]

    def __post_init__(self) -> None:
        if not (len(self.subjects) == len(self.prefixes) == len(self.questions)
                == len(self.answers)):
            raise ValueError("subjects, prefixes, questions and answers must align")
        if any(not qs for qs in self.questions):
            raise ValueError("every subject needs at least one question")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MMLU_TOKENS_FORMAT,
            "tokenizer": self.tokenizer,
            "subjects": list(self.subjects),
            "prefixes": [list(p) for p in self.prefixes],
            "questions": [[list(q) for q in qs] for qs in self.questions],
            "answers": [[list(a) for a in ans] for ans in self.answers],
            "markers": {k: list(v) for k, v in self.markers.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenizedMMLU:
        if data.get("format") != MMLU_TOKENS_FORMAT:
            raise ValueError(f"token cache format {data.get('format')} != {MMLU_TOKENS_FORMAT}")
        return cls(
            tokenizer=str(data["tokenizer"]),
            subjects=tuple(data["subjects"]),
            prefixes=tuple(tuple(p) for p in data["prefixes"]),
            questions=tuple(tuple(tuple(q) for q in qs) for qs in data["questions"]),
            answers=tuple(tuple(tuple(a) for a in ans) for ans in data["answers"]),
            markers={k: tuple(v) for k, v in data["markers"].items()},
        )


def _shuffled_ranks(n: int, seed: int) -> list[int]:
    """A seeded popularity order: rank r (0 = most popular) is item order[r]."""
    order = list(range(n))
    random.Random(f"{seed}/ranks").shuffle(order)
    return order


def mmlu_requests(
    data: TokenizedMMLU,
    n: int,
    rate_per_s: float,
    zipf_s: float,
    max_new_tokens: int = 8,
    seed: int = 0,
    subjects: int | None = None,
) -> list[TokenRequest]:
    """The MMLU serving workload: Poisson arrivals; each request picks a subject by
    Zipf(s) over a seeded popularity order, then a question of that subject uniformly.

    The prompt is the subject's 5-shot prefix (shared) plus the question (unique).
    `subjects` keeps only the first k subjects of the popularity order.
    """
    if not 0 < n <= MAX_WORKLOAD_REQUESTS:
        raise ValueError(f"n must be in [1, {MAX_WORKLOAD_REQUESTS}], got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    order = _shuffled_ranks(len(data.subjects), seed)
    if subjects is not None:
        if not 1 <= subjects <= len(order):
            raise ValueError(f"subjects must be in [1, {len(order)}], got {subjects}")
        order = order[:subjects]
    weights = zipf_weights(len(order), zipf_s)
    rng = random.Random(f"{seed}/mmlu")
    arrivals = poisson_arrivals(rng, n, rate_per_s)
    picks = rng.choices(order, weights, k=n)
    out = []
    for t, k in zip(arrivals, picks, strict=True):
        q = rng.randrange(len(data.questions[k]))
        out.append(TokenRequest(t, k, data.prefixes[k], data.questions[k][q], max_new_tokens,
                                group=k, output=data.answers[k][q]))
    return out


def system_prompt_requests(
    data: TokenizedMMLU,
    n: int,
    rate_per_s: float,
    groups: int = 32,
    zipf_s: float = 1.0,
    min_prompt_tokens: int = 256,
    max_prompt_tokens: int = 2048,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> list[TokenRequest]:
    """Shared system prompts: `groups` long prefixes of log-uniform lengths in
    [min, max] tokens, popularity Zipf(s); each request adds a user question.

    A system prompt is real text: ChatML system header, then MMLU questions of one subject
    (their token ids) cut to length; the user turn is a random MMLU question.
    """
    if groups < 1 or not 1 <= min_prompt_tokens <= max_prompt_tokens:
        raise ValueError("need groups >= 1 and 1 <= min_prompt_tokens <= max_prompt_tokens")
    rng = random.Random(f"{seed}/system")
    m = data.markers
    prompts: list[tuple[int, ...]] = []
    for g in range(groups):
        length = round(math.exp(rng.uniform(math.log(min_prompt_tokens),
                                            math.log(max_prompt_tokens))))
        subject = g % len(data.subjects)
        body: list[int] = list(m["system"])
        for q in itertools.cycle(data.questions[subject]):
            if len(body) >= length:
                break
            body.extend(q)
        prompts.append(tuple(body[:length]) + m["end"])
    weights = zipf_weights(groups, zipf_s)
    order = _shuffled_ranks(groups, seed)
    out = []
    for t in poisson_arrivals(rng, n, rate_per_s):
        g = rng.choices(order, weights)[0]
        k = rng.randrange(len(data.subjects))
        q = data.questions[k][rng.randrange(len(data.questions[k]))]
        suffix = m["user"] + q + m["end"] + m["assistant"]
        out.append(TokenRequest(t, g, prompts[g], suffix, max_new_tokens, group=g))
    return out


def chat_requests(
    data: TokenizedMMLU,
    conversations: int,
    rate_per_s: float,
    turns: tuple[int, int] = (2, 6),
    think_s: float = 20.0,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> list[TokenRequest]:
    """Multi-turn chat: conversations start as a Poisson process of `rate_per_s`; each has
    a uniform number of turns in `turns`; the next turn comes an exponential think time
    (mean `think_s`) after the previous one. Turn k's prompt is turn k-1's prompt, its
    reply and a new user message, so a conversation's prompts extend each other.

    Messages are MMLU questions, replies their correct answer's text (real token ids).
    Arrivals are open-loop: a turn does not wait for the previous reply in the simulator.
    """
    if conversations < 1 or not 1 <= turns[0] <= turns[1]:
        raise ValueError("need conversations >= 1 and 1 <= turns[0] <= turns[1]")
    rng = random.Random(f"{seed}/chat")
    m = data.markers
    out = []
    for c, start in enumerate(poisson_arrivals(rng, conversations, rate_per_s)):
        history: tuple[int, ...] = m["system"] + m["end"]
        t = start
        for turn in range(rng.randint(*turns)):
            k = rng.randrange(len(data.subjects))
            q = rng.randrange(len(data.questions[k]))
            suffix = m["user"] + data.questions[k][q] + m["end"] + m["assistant"]
            reply = data.answers[k][q][:max_new_tokens]
            key = (c << 8) | turn  # a conversation's turns never share a full prompt
            out.append(TokenRequest(t, key, history, suffix, max(1, len(reply)), group=c,
                                    output=reply, turn=turn))
            history = history + suffix + reply + m["end"]
            t += rng.expovariate(1.0 / think_s)
    out.sort(key=lambda r: r.arrival_s)
    return out


def agent_requests(
    data: TokenizedMMLU,
    sessions: int,
    rate_per_s: float,
    agents: int = 4,
    system_tokens: tuple[int, int] = (1000, 2000),
    steps: tuple[int, int] = (2, 6),
    tool_output_tokens: int = 200,
    call_tokens: int = 24,
    tool_s: float = 2.0,
    seed: int = 0,
) -> list[TokenRequest]:
    """Agentic sessions: a few agents, each with a long system prompt (its instructions and
    tool descriptions) that all of its sessions share; a session is a task and then tool
    calls. Sessions start as a Poisson process of `rate_per_s`, pick an agent uniformly and
    run a uniform number of `steps`. Each step's prompt is the previous one plus the
    model's tool call (its reply) and the tool's output; the next step comes an exponential
    tool latency (mean `tool_s`) after the previous one (open loop, as chat_requests).

    Real token ids: system prompts are ChatML system headers followed by MMLU questions of
    one subject cut to a log-uniform length in `system_tokens`; a task is an MMLU question;
    a tool call is the first `call_tokens` tokens of another question and the answer's
    text; a tool output is an MMLU question cut to `tool_output_tokens`.
    """
    if sessions < 1 or agents < 1 or not 1 <= steps[0] <= steps[1]:
        raise ValueError("need sessions >= 1, agents >= 1 and 1 <= steps[0] <= steps[1]")
    if not 1 <= system_tokens[0] <= system_tokens[1]:
        raise ValueError("need 1 <= system_tokens[0] <= system_tokens[1]")
    rng = random.Random(f"{seed}/agent")
    m = data.markers
    systems: list[tuple[int, ...]] = []
    for a in range(agents):
        length = round(math.exp(rng.uniform(math.log(system_tokens[0]),
                                            math.log(system_tokens[1]))))
        subject = (a * 7) % len(data.subjects)
        body: list[int] = list(m["system"])
        for q in itertools.cycle(data.questions[subject]):
            if len(body) >= length:
                break
            body.extend(q)
        systems.append(tuple(body[:length]) + m["end"])

    def question() -> tuple[int, ...]:
        k = rng.randrange(len(data.subjects))
        return data.questions[k][rng.randrange(len(data.questions[k]))]

    out = []
    for session, start in enumerate(poisson_arrivals(rng, sessions, rate_per_s)):
        a = rng.randrange(agents)
        prefix, key = systems[a], a  # the first step shares the agent's system prompt
        suffix = m["user"] + question() + m["end"] + m["assistant"]
        t = start
        for step in range(rng.randint(*steps)):
            k = rng.randrange(len(data.subjects))
            q = rng.randrange(len(data.questions[k]))
            call = data.questions[k][q][:call_tokens] + data.answers[k][q]
            out.append(TokenRequest(t, key, prefix, suffix, len(call), group=session,
                                    output=call, turn=step))
            prefix = prefix + suffix + call + m["end"]
            key = agents + ((session << 8) | step)  # unique: no two steps share a prompt
            suffix = m["user"] + question()[:tool_output_tokens] + m["end"] + m["assistant"]
            t += rng.expovariate(1.0 / tool_s)
    out.sort(key=lambda r: r.arrival_s)
    return out


Encoder = Callable[[list[str]], list[list[int]]]  # texts -> token ids, no special tokens


def mmlu_prompt_parts(
    questions: Sequence[MmluQuestion], num_shots: int = NUM_SHOTS
) -> tuple[str, list[str], list[str]]:
    """One subject's 5-shot prompt split for tokenization: (prefix, question suffixes,
    answer texts). prefix + suffix is exactly `five_shot_prompt`; the cut sits before
    the blank line that precedes the new question, where BPE pre-tokenization splits."""
    if len(questions) <= num_shots:
        raise ValueError(f"a subject needs more than {num_shots} questions, got {len(questions)}")
    examples, rest = questions[:num_shots], questions[num_shots:]
    header = five_shot_header(questions[0].subject, examples)
    prefix = header[:-2]  # without the trailing "\n\n"
    suffixes = ["\n\n" + format_question(q, with_answer=False) for q in rest]
    answers = [" " + q.choices[CHOICE_LETTERS.index(q.answer)] for q in rest]
    return prefix, suffixes, answers


def tokenize_mmlu(encode: Encoder, tokenizer: str,
                  questions: Sequence[MmluQuestion] | None = None) -> TokenizedMMLU:
    """Every subject's prefix and every question's suffix as token ids.

    Checks on each subject's first question that tokens(prefix) + tokens(suffix) equals
    tokens(full prompt); ValueError if not (the split would not match the engine's
    tokenization).
    """
    groups = by_subject(load_mmlu() if questions is None else questions)
    subjects = sorted(groups)
    parts = [mmlu_prompt_parts(groups[s]) for s in subjects]
    texts: list[str] = []
    for prefix, suffixes, answers in parts:
        texts += [prefix, *suffixes, *answers]
    checks = [five_shot_prompt(s, groups[s][NUM_SHOTS], groups[s][:NUM_SHOTS]) for s in subjects]
    ids = encode(texts + checks + list(CHAT_MARKERS.values()))
    pos = 0
    prefixes, qs, ans = [], [], []
    for (_, suffixes, answers), subject, check in zip(
        parts, subjects, ids[len(texts) : len(texts) + len(subjects)], strict=True
    ):
        prefix_ids = tuple(ids[pos])
        pos += 1
        suffix_ids = tuple(tuple(x) for x in ids[pos : pos + len(suffixes)])
        pos += len(suffixes)
        ans.append(tuple(tuple(x) for x in ids[pos : pos + len(answers)]))
        pos += len(answers)
        if prefix_ids + suffix_ids[0] != tuple(check):
            raise ValueError(f"{subject}: tokens(prefix) + tokens(question) differ from "
                             "tokens(prompt); the prompt split does not suit this tokenizer")
        prefixes.append(prefix_ids)
        qs.append(suffix_ids)
    marker_ids = ids[len(texts) + len(subjects) :]
    markers = {k: tuple(v) for k, v in zip(CHAT_MARKERS, marker_ids, strict=True)}
    return TokenizedMMLU(tokenizer, tuple(subjects), tuple(prefixes), tuple(qs), tuple(ans),
                         markers)


def smollm2_encoder() -> tuple[Encoder, str]:
    """The SmolLM2 tokenizer as an Encoder (loaded through peer.engine.model's cache)."""
    from peer.engine.embedded import load_smollm2_tokenizer

    tok: Any = load_smollm2_tokenizer()

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]

    return encode, f"SmolLM2-135M-Instruct (vocab {len(tok)})"


def mmlu_tokens_path() -> Path:
    """Where the tokenized MMLU workload is cached: $PREFIXSWARM_CACHE_DIR (or
    ~/.cache/prefixswarm/models) / MMLU_TOKENS_FILE."""
    from peer.engine.embedded import cache_dir

    return cache_dir() / MMLU_TOKENS_FILE


def load_tokenized_mmlu(path: Path | None = None) -> TokenizedMMLU:
    """The tokenized MMLU workload, from the on-disk cache or tokenized now (~15 s) and
    cached. The cache is rebuilt when its format or the MMLU file's size changes."""
    path = path or mmlu_tokens_path()
    source = mmlu_path()
    stamp = f"{source.stat().st_size}"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("source_size") == stamp:
                return TokenizedMMLU.from_json(data)
        except (ValueError, KeyError, TypeError) as exc:
            print(f"bench.workloads: rebuilding {path} ({exc})", file=sys.stderr)
    start = time.perf_counter()
    encode, name = smollm2_encoder()
    tokenized = tokenize_mmlu(encode, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**tokenized.to_json(), "source_size": stamp}))
    os.replace(tmp, path)
    print(f"bench.workloads: tokenized MMLU in {time.perf_counter() - start:.1f} s -> {path}",
          file=sys.stderr)
    return tokenized
