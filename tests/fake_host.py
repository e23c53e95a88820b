"""A scripted swarm behind the pipeline's interfaces, for tests under a virtual clock.

`FakeEngine` generates a fixed sequence (each token a function of the previous one) with
scripted delays and verifies outputs against it. `FakeHost.new_stream` plays each remote
peer's script: an async generator of `Step`s (sleep, then send a frame; or stall; or
break the stream). No threads, no sockets: under `autojump_clock` every time is exact.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from peer.config import PeerConfig, Policy
from peer.engine.api import Completion, EngineLoad, SamplingParams, TokenEvent, Usage, Verdict
from peer.net.wire import PeerUnreachable
from peer.request.admission import Admission
from peer.request.generation import GenerationRequest
from peer.request.pipeline import Pipeline
from peer.routing.router import Router
from peer.routing.trust import TrustLedger
from peer.swarm.peer_table import PeerTable
from protocols.answers import signed_bytes
from protocols.blocks import BlockHasher
from protocols.bloom import BloomFilter
from protocols.framing import FrameDecoder, encode_frame
from protocols.ids import LOAD_PROTOCOL
from protocols.infer import FinishReason, InferRequest, InferResult, TokenChunk, parse_request
from protocols.load import LoadReport, decode_load_query
from protocols.summary import CacheSummary

MODEL = "fake-model"
BLOCK = 4
VOCAB = 1000


SIGNERS: dict[str, Any] = {}  # peer id -> its private key: fake peers sign their answers


def new_peer_id(seed: int) -> str:
    keys = create_new_key_pair(bytes([seed]) * 32)
    peer_id = ID.from_pubkey(keys.public_key).to_base58()
    SIGNERS[peer_id] = keys.private_key
    return peer_id


def next_token(token: int) -> int:
    return (token * 7 + 1) % VOCAB


def reference(prompt: Sequence[int], n: int) -> list[int]:
    """The one correct continuation of ``prompt`` (what every honest peer generates)."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


class FakeEngine:
    """Generates `reference`: first token after `ttft_s`, then one per `gap_s`."""

    model_id = MODEL
    block_size = BLOCK
    vocab_size = VOCAB

    def __init__(self, ttft_s: float = 0.5, gap_s: float = 0.01) -> None:
        self.hasher = BlockHasher(MODEL, BLOCK)
        self.ttft_s = ttft_s
        self.gap_s = gap_s
        self.verified: list[tuple[list[int], list[int]]] = []

    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        params.validate()
        return list(token_ids)

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 1000.0, 100.0)

    def generating(self) -> FakeEngine:
        return self

    def local_match_tokens(self, token_ids: Sequence[int]) -> int:
        return 0

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)

    async def stream(
        self, prompt: Sequence[int], params: SamplingParams, *, cache_salt: bytes | None = None,
        background: bool = False,
    ) -> AsyncIterator[Any]:
        await trio.sleep(self.ttft_s)
        out = reference(prompt, params.max_new_tokens)
        for i, token in enumerate(out):
            if i:
                await trio.sleep(self.gap_s)
            yield TokenEvent(i, token, self.decode([token]))
        usage = Usage(len(prompt), 0, len(out), self.ttft_s, 0.0, 0.0)
        yield Completion(tuple(out), self.decode(out), "length", usage)

    async def verify(
        self, prompt_ids: list[int], output_ids: list[int], params: SamplingParams
    ) -> Verdict:
        self.verified.append((list(prompt_ids), list(output_ids)))
        good = reference(prompt_ids, len(output_ids))
        for i, (a, b) in enumerate(zip(output_ids, good, strict=True)):
            if a != b:
                return Verdict(False, i, f"token {i} is {a}, expected {b}", i + 1)
        return Verdict(True, None, "", len(output_ids))


class CacheOnlyVerifier(FakeEngine):
    """An engine without `verify` (like a cache-only one): verification is skipped."""

    verify = None  # type: ignore[assignment]


# -- remote peers ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    delay_s: float = 0.0
    frame: TokenChunk | InferResult | None = None  # None: break the stream (EOF)


STALL = Step(delay_s=float("inf"))

Script = Callable[[InferRequest], Sequence[Step]]


def honest(ttft_s: float = 0.01, gap_s: float = 0.01, cached: int = 0) -> Script:
    """A peer that answers `reference` token by token."""

    def script(request: InferRequest) -> list[Step]:
        return answer(request, reference(request.prompt_token_ids, request.max_new_tokens),
                      ttft_s, gap_s, cached)

    return script


def answer(
    request: InferRequest, tokens: Sequence[int], ttft_s: float = 0.01, gap_s: float = 0.01,
    cached: int = 0, served_by: str = "honest-peer", text: str | None = None,
) -> list[Step]:
    steps = [
        Step(ttft_s if i == 0 else gap_s, TokenChunk((t,), text if text is not None else ""))
        for i, t in enumerate(tokens)
    ]
    steps.append(Step(0.0, InferResult(
        prompt_tokens=len(request.prompt_token_ids), cached_tokens=cached,
        completion_tokens=len(tokens), ttft_s=ttft_s, decode_tokens_per_s=1.0, total_s=1.0,
        finish_reason=FinishReason.LENGTH, served_by=served_by,
    )))
    return steps


class FakeStream:
    def __init__(self, host: FakeHost, peer_id: str, script: Script) -> None:
        self._host = host
        self.peer_id = peer_id
        self._script = script
        self._steps: list[Step] | None = None
        self._decoder = FrameDecoder()
        self.was_reset = False
        self.request: InferRequest | None = None
        self._sent: list[int] = []
        self.direct = not host.open_delay_s.get(peer_id)  # no dial or relay before it

    async def write(self, data: bytes) -> None:
        self._decoder.feed(data)
        frame = self._decoder.next_frame()
        if frame is not None:
            self.request = parse_request(frame, VOCAB)
            self._steps = list(self._script(self.request))
            self._host.requests.append((trio.current_time(), self.peer_id, self.request))

    async def read(self, n: int | None = None) -> bytes:
        if self._steps is None:
            await trio.sleep_forever()
        assert self._steps is not None
        if not self._steps:
            return b""
        step = self._steps.pop(0)
        await trio.sleep(step.delay_s)
        if step.frame is None:
            raise BaseLibp2pError("stream reset by peer")
        frame = step.frame
        if isinstance(frame, TokenChunk):
            self._sent.extend(frame.token_ids)
        elif (isinstance(frame, InferResult) and not frame.signature
              and self.peer_id in SIGNERS and self.request is not None):
            # the peer signs what it sent, as every peer does (protocols/answers.py)
            message = signed_bytes(self.peer_id, self.request, self._sent, frame.finish_reason)
            frame = replace(frame, signature=SIGNERS[self.peer_id].sign(message))
        return encode_frame(frame.to_wire())

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.was_reset = True
        self._host.resets.append((trio.current_time(), self.peer_id))


@dataclass(frozen=True)
class LoadAnswer:
    """How a peer answers a load probe: after ``delay_s``, ``report`` (None: the stream
    breaks) or, if given, ``raw`` bytes as the frame's CBOR payload."""

    delay_s: float
    report: LoadReport | None
    raw: bytes | None = None


class FakeLoadStream:
    def __init__(self, host: FakeHost, peer_id: str, answer: LoadAnswer) -> None:
        self._host = host
        self.peer_id = peer_id
        self._answer = answer
        self._decoder = FrameDecoder()
        self._asked = False
        self._sent = False

    async def write(self, data: bytes) -> None:
        self._decoder.feed(data)
        frame = self._decoder.next_frame()
        if frame is not None:
            decode_load_query(frame)
            self._asked = True

    async def read(self, n: int | None = None) -> bytes:
        if not self._asked:
            await trio.sleep_forever()
        if self._sent:
            return b""
        self._sent = True
        await trio.sleep(self._answer.delay_s)
        self._host.load_answers.append((trio.current_time(), self.peer_id))
        if self._answer.raw is not None:
            return len(self._answer.raw).to_bytes(4, "big") + self._answer.raw
        if self._answer.report is None:
            raise BaseLibp2pError("stream reset by peer")
        return encode_frame(self._answer.report.to_wire())

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self._host.probe_resets.append((trio.current_time(), self.peer_id))


@dataclass
class FakeHost:
    """Opens FakeStreams to scripted peers; records when each was dialed and reset.
    Load probes (``load`` answers; a peer without one refuses the protocol) are kept
    apart from forwards: ``probes``, ``load_answers``, ``probe_resets``."""

    scripts: dict[str, Script] = field(default_factory=dict)
    dials: list[tuple[float, str]] = field(default_factory=list)
    requests: list[tuple[float, str, InferRequest]] = field(default_factory=list)
    resets: list[tuple[float, str]] = field(default_factory=list)
    load: dict[str, LoadAnswer] = field(default_factory=dict)
    probes: list[tuple[float, str]] = field(default_factory=list)
    load_answers: list[tuple[float, str]] = field(default_factory=list)
    probe_resets: list[tuple[float, str]] = field(default_factory=list)
    open_delay_s: dict[str, float] = field(default_factory=dict)  # a dial or a relay's setup

    async def new_stream(self, peer_id: ID, protocols: Sequence[str], *,
                         timeout_s: float = 10.0, lazy: bool = False,
                         ) -> FakeStream | FakeLoadStream:
        pid = peer_id.to_base58()
        await trio.sleep(self.open_delay_s.get(pid, 0.0))
        if LOAD_PROTOCOL in protocols:
            self.probes.append((trio.current_time(), pid))
            if pid not in self.load:
                raise PeerUnreachable(f"{pid} does not speak {LOAD_PROTOCOL}")
            return FakeLoadStream(self, pid, self.load[pid])
        self.dials.append((trio.current_time(), pid))
        return FakeStream(self, pid, self.scripts[pid])

    def dialed(self) -> list[str]:
        return [p for _, p in self.dials]


# -- a pipeline over all of it ----------------------------------------------------------------


def request(
    prompt: Sequence[int], params: SamplingParams, *, request_id: str = "request",
    cache_salt: bytes | None = None, timeout_s: float | None = None,
) -> GenerationRequest:
    """What Serving.prepare would hand the pipeline (the fake engine validates nothing)."""
    params.validate()
    return GenerationRequest(request_id, tuple(prompt), params, cache_salt, timeout_s)


SELF = new_peer_id(0)


def summary_for(peer_id: str, chain: Sequence[int], *, prefill: float = 1000.0,
                decode: float = 100.0, seq: int = 1, queued: int = 0,
                running: int = 0) -> CacheSummary:
    bloom = BloomFilter.for_capacity(256, 0.01)
    bloom.update(chain)
    return CacheSummary(
        peer_id=peer_id, model_id=MODEL, block_size=BLOCK, seq=seq, bloom_bits=bloom.num_bits,
        bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(), cached_blocks=len(set(chain)),
        capacity_blocks=256, queued_prompt_tokens=queued, running_requests=running,
        prefill_tokens_per_s=prefill, decode_tokens_per_s=decode,
    )


@dataclass
class Swarm:
    pipeline: Pipeline
    host: FakeHost
    table: PeerTable
    engine: FakeEngine
    trust: TrustLedger


def fake_peers(
    peers: dict[str, tuple[int, Script]],
    prompt: Sequence[int],
    engine: FakeEngine,
    rtt_s: dict[str, float | None] | None = None,
    running: dict[str, int] | None = None,
) -> tuple[PeerTable, FakeHost]:
    """A table holding ``peers`` (id -> (blocks of ``prompt`` it claims, its script)),
    each with a measured round trip unless ``rtt_s`` says None and the gossiped running
    requests of ``running`` (else none), and a host playing them."""
    table = PeerTable(SELF, MODEL, BLOCK, expiry_s=1e9)
    chain = engine.hasher.chain(prompt)
    host = FakeHost()
    for peer_id, (blocks, script) in peers.items():
        summary = summary_for(peer_id, chain[:blocks], running=(running or {}).get(peer_id, 0))
        assert table.apply(summary, peer_id, 0.0).accepted
        rtt = (rtt_s or {}).get(peer_id, 0.001)
        if rtt is not None:
            table.record_rtt(peer_id, rtt, 0.0)
        host.scripts[peer_id] = script
    return table, host


def fake_config(**overrides: Any) -> PeerConfig:
    """LONGEST_PREFIX (the longest claim first, this peer last), no verification, no
    hedging, a 1 s first-token floor: each test turns on what it tests."""
    fields: dict[str, Any] = dict(
        identity_file=None, policy=Policy.LONGEST_PREFIX, verify_fraction=0.0,
        first_token_floor_s=1.0, first_token_multiple=4.0, hedge_multiple=0.0,
    )
    fields.update(overrides)
    return PeerConfig(**fields)


def fake_swarm(
    peers: dict[str, tuple[int, Script]],
    prompt: Sequence[int],
    *,
    engine: FakeEngine | None = None,
    rtt_s: dict[str, float | None] | None = None,
    trusted: bool = True,
    running: dict[str, int] | None = None,
    **config: Any,
) -> Swarm:
    """A pipeline over `fake_peers`; ``trusted``: the peers passed probation already."""
    engine = engine or FakeEngine()
    cfg = fake_config(**config)
    trust = TrustLedger(
        verify_fraction=cfg.verify_fraction, probation_requests=cfg.probation_requests,
        can_verify=engine.verify is not None,
    )
    table, host = fake_peers(peers, prompt, engine, rtt_s, running)
    if trusted:
        for peer_id in peers:
            for _ in range(cfg.probation_requests):
                trust.record_served(peer_id, verified=True)
    router = Router(cfg.policy, random.Random(0), block_size=BLOCK, trust=trust, require_rtt=True)
    pipeline = Pipeline(
        config=cfg, engine=engine, router=router, table=table, host=host,
        admission=Admission(cfg.max_queue), self_id=SELF, trust=trust, rng=random.Random(0),
    )
    return Swarm(pipeline, host, table, engine, trust)
