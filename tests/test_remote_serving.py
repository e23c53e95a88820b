"""Serving other peers: quarantined ids are refused, each identity is budgeted, and the
engine runs requests served for other peers after this peer's own (virtual time)."""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio
import trio.testing
from libp2p.peer.id import ID

from peer.engine.api import EngineLoad
from peer.engine.scheduler import BatchQueue
from peer.request.admission import Admission
from peer.request.budget import BudgetPolicy, RemoteBudget
from peer.request.inference import InferenceService
from protocols.framing import FrameDecoder, encode_frame
from protocols.infer import ErrorCode, InferError, InferRequest, InferResult, parse_response
from tests.fake_host import VOCAB, FakeEngine

STRANGER = ID(b"\x00\x05stray")


@dataclass
class _Seq:
    rid: int
    tokens: Sequence[int]
    pos: int = 0
    background: bool = False


def test_background_sequences_join_and_prefill_after_the_peers_own() -> None:
    queue: BatchQueue[_Seq] = BatchQueue(rank=lambda s: int(s.background))
    remote = [_Seq(i, [1] * 600, background=True) for i in range(3)]
    own = _Seq(3, [2] * 100)
    for seq in (*remote, own):
        queue.submit(seq)
    queue.admit(2, lambda s: None)
    assert list(queue.batch) == [3, 0]  # ours first, then the oldest remote one
    assert [s.rid for s in queue.waiting] == [1, 2]  # still in arrival order
    plan = queue.plan(256)
    assert plan.prefill == ((3, 100),)  # our prompt is read alone
    own.pos = 100  # read: it decodes now, and the remote prompt gets a quarter step
    plan = queue.plan(256)
    assert plan.decode == (3,) and plan.prefill == ((0, 64),)
    unranked: BatchQueue[_Seq] = BatchQueue()  # without a rank: oldest first, as before
    for seq in (*remote, own):
        unranked.submit(seq)
    unranked.admit(2, lambda s: None)
    assert list(unranked.batch) == [0, 1]


def test_our_prompt_steps_hold_the_others_decodes_back_every_other_step() -> None:
    queue: BatchQueue[_Seq] = BatchQueue(rank=lambda s: int(s.background))
    remote = [_Seq(i, [1] * 4, pos=4, background=True) for i in range(3)]  # decoding
    mine = _Seq(3, [3] * 8, pos=8)  # one of ours, decoding too
    own = _Seq(4, [2] * 2000)  # ours, reading a long prompt
    for seq in (*remote, mine, own):
        queue.submit(seq)
    queue.admit(8, lambda s: None)
    decodes = []
    for _ in range(4):
        plan = queue.plan(256)
        assert plan.prefill == ((4, 255),) or plan.prefill == ((4, 252),)
        decodes.append(plan.decode)
        own.pos += plan.prefill[0][1]
    # ours every step; the others' every other step, so they wait one step at most
    assert decodes == [(3,), (3, 0, 1, 2), (3,), (3, 0, 1, 2)]
    own.pos = len(own.tokens)  # read: everyone decodes in every step again
    assert queue.plan(256).decode == (3, 4, 0, 1, 2)
    assert queue.plan(256).decode == (3, 4, 0, 1, 2)


class _Pipe:
    """One end of a trio memory stream with the libp2p stream methods FrameStream uses."""

    def __init__(self, stream: Any) -> None:
        self._s = stream
        self.muxed_conn = types.SimpleNamespace(peer_id=STRANGER)

    async def read(self, n: int | None = None) -> bytes:
        try:
            return bytes(await self._s.receive_some(n))
        except trio.ClosedResourceError:
            return b""

    async def write(self, data: bytes) -> None:
        await self._s.send_all(data)

    async def close(self) -> None:
        await self._s.aclose()

    async def reset(self) -> None:
        await self._s.aclose()


class _RecordingEngine(FakeEngine):
    def __init__(self, busy: bool = False) -> None:
        super().__init__(ttft_s=0.1, gap_s=0.01)
        self.background: list[bool] = []
        self.busy = busy  # our own clients' requests keep the engine running

    def load(self) -> EngineLoad:
        return EngineLoad(0, int(self.busy), 1000.0, 100.0)

    def stream(self, prompt: Any, params: Any, *, cache_salt: Any = None,
               background: bool = False) -> Any:
        self.background.append(background)
        return super().stream(prompt, params)


async def _ask(service: InferenceService, request: InferRequest) -> list[Any]:
    ours, theirs = trio.testing.memory_stream_pair()
    frames: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._serve_one, _Pipe(theirs), STRANGER.to_base58())
        await ours.send_all(encode_frame(request.to_wire()))
        decoder = FrameDecoder(1 << 20)
        while data := await ours.receive_some(1 << 16):
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                frames.append(parse_response(frame, VOCAB))
    return frames


def _request(prompt_tokens: int = 2000, max_new_tokens: int = 8) -> InferRequest:
    return InferRequest("r", tuple([5] * prompt_tokens), max_new_tokens, deadline_s=60.0)


async def test_a_quarantined_peer_is_refused_with_a_typed_error(autojump_clock: Any) -> None:
    engine = _RecordingEngine()
    quarantined = {STRANGER.to_base58()}
    service = InferenceService(
        engine, Admission(4), self_id="me", max_inbound_per_peer=4,
        refuses=lambda peer_id: peer_id in quarantined,
    )
    frames = await _ask(service, _request())
    assert len(frames) == 1 and isinstance(frames[0], InferError)
    assert frames[0].code is ErrorCode.REFUSED and frames[0].retryable
    assert engine.background == []  # the engine never saw it
    quarantined.clear()
    frames = await _ask(service, _request())
    assert isinstance(frames[-1], InferResult)
    assert engine.background == [True]  # served, behind this peer's own requests


async def test_a_trusted_peers_forwards_queue_beside_our_own_clients(autojump_clock: Any) -> None:
    engine = _RecordingEngine()
    trusted: set[str] = set()
    service = InferenceService(
        engine, Admission(4), self_id="me", max_inbound_per_peer=4,
        trusted=lambda peer_id: peer_id in trusted,
    )
    assert isinstance((await _ask(service, _request()))[-1], InferResult)
    trusted.add(STRANGER.to_base58())  # it served us honestly: its clients are ours too
    assert isinstance((await _ask(service, _request()))[-1], InferResult)
    assert engine.background == [True, False]
    assert service.statistics()["served_background"] == 1
    assert service.statistics()["served_trusted"] == 1


async def test_a_stranger_over_its_budget_is_refused_until_it_refills(autojump_clock: Any) -> None:
    engine = _RecordingEngine(busy=True)  # prefill 1000 tokens/s, decode 100 tokens/s
    budget = RemoteBudget(BudgetPolicy(identity_share=0.25, remote_share=0.5, burst_s=8.0))
    service = InferenceService(
        engine, Admission(4), self_id="me", max_inbound_per_peer=4, budget=budget
    )
    # Each request costs 2000 / 1000 + 8 / 100 = 2.08 engine-seconds: the identity's
    # bucket holds 2, so the first runs (a full bucket admits any one request) ...
    first = await _ask(service, _request())
    assert isinstance(first[-1], InferResult)
    refused = await _ask(service, _request())
    assert isinstance(refused[0], InferError) and refused[0].code is ErrorCode.OVER_BUDGET
    assert "retry after" in refused[0].message
    await trio.sleep(8.5)  # ... the next once the debt is paid, in 2.08 / 0.25 = 8.3 s
    again = await _ask(service, _request())
    assert isinstance(again[-1], InferResult)
    stats = service.statistics()
    assert stats["refused_over_budget"] == 1 and stats["remote_admitted"] == 2
    engine.busy = False  # an idle engine serves it over budget, and charges it
    idle = await _ask(service, _request())
    assert isinstance(idle[-1], InferResult)
    assert service.statistics()["remote_admitted_idle"] == 1
