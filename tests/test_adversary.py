"""The rogue really misbehaves (so bench.adversary cannot measure an honest rogue by
mistake), and the bench's JSON has the keys docs/security.md reports."""

from __future__ import annotations

import dataclasses
import random
import types
from typing import Any

import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.validators import signature_validator

from bench.adversary import LIARS, SCENARIOS, Outcome, parse_args, summarise
from bench.rogue import Mode, Rogue
from bench.rogues.lies import (
    EXTRA_TOKENS,
    NUCLEUS_MARGIN,
    POISON_SPEED,
    forged_message,
    out_of_nucleus,
    poisoned_summary,
)
from bench.swarm import PeerProcess
from peer.engine.engine import SamplingParams
from peer.swarm.peer_table import PeerTable
from protocols.framing import FrameDecoder, encode_frame
from protocols.infer import InferRequest, InferResult, TokenChunk, parse_response
from protocols.summary import decode_summary, encode_summary

MODEL = "tiny-random"
PEER = "12D3KooWRoguePeer"


class _Pipe:
    """One end of a trio memory stream with the libp2p stream methods FrameStream uses."""

    def __init__(self, stream: Any) -> None:
        self._s = stream
        self.muxed_conn = types.SimpleNamespace(peer_id=ID(b"\x00\x05entry"))

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


async def _exchange(
    rogue: Rogue, request: InferRequest, serve: Any, vocab: int
) -> tuple[list[Any], float]:
    """Send `request` to the rogue's handler, collect every frame until the stream ends."""
    ours, theirs = trio.testing.memory_stream_pair()
    frames: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, _Pipe(theirs))
        await ours.send_all(encode_frame(request.to_wire()))
        decoder = FrameDecoder(1 << 20)
        while True:
            data = await ours.receive_some(1 << 16)
            if not data:
                break
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                frames.append(parse_response(frame, vocab))
    return frames, trio.current_time()


def _request(**kwargs: Any) -> InferRequest:
    fields: dict[str, Any] = {
        "request_id": "r1", "prompt_token_ids": tuple(range(1, 40)), "max_new_tokens": 4,
        "deadline_s": 100.0,
    }
    fields.update(kwargs)
    return InferRequest(**fields)


def test_poisoned_summary_is_accepted_by_an_honest_table() -> None:
    summary = poisoned_summary(PEER, MODEL, 16, 1, random.Random(0))
    summary = decode_summary(encode_summary(summary))  # survives the wire
    table = PeerTable(self_id="12D3KooWHonest", model_id=MODEL, block_size=16, expiry_s=3.0)
    result = table.apply(summary, PEER, now=0.0)
    assert result.accepted, result.detail
    bloom = summary.bloom_filter()
    assert summary.bloom_hashes == 1 and 0.85 < bloom.fill_ratio() <= 0.9
    assert summary.queued_prompt_tokens == 0 and summary.running_requests == 0
    assert summary.prefill_tokens_per_s == summary.decode_tokens_per_s == POISON_SPEED
    # It claims most of any prompt: 5 random blocks match with probability ~0.88^5.
    rng = random.Random(1)
    hits = sum(rng.getrandbits(64) in bloom for _ in range(1000))
    assert 830 < hits < 930


def test_forged_message_is_validly_signed_by_a_stranger() -> None:
    keys = create_new_key_pair(random.Random(2).randbytes(32))
    msg = forged_message(keys, "topic", b"data", random.Random(3))
    assert signature_validator(msg)
    assert ID(msg.from_id) == ID.from_pubkey(keys.public_key)


def test_out_of_nucleus_is_never_sampled() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    token = out_of_nucleus(logits, temperature=1.0, top_p=0.9)
    probs = torch.softmax(logits, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    # The nucleus keeps a token while the mass before it is < top_p (+ the margin, 0.95):
    # the top 3 (0.634, 0.233, 0.086; mass before the 4th 0.953); the 4th is the answer.
    assert token == order[3]


async def test_liar_staller_holds_the_stream_until_the_deadline(autojump_clock: Any) -> None:
    engine = types.SimpleNamespace(vocab_size=100, decode=lambda ids: "x")
    rogue = Rogue(Mode.LIAR_STALLER, engine, random.Random(0))
    frames, end = await _exchange(
        rogue, _request(deadline_s=100.0), lambda s: rogue._misbehave(s, "ENTRY"), 100
    )
    assert frames == [] and end == pytest.approx(100.0)
    assert rogue.answered["stalled"] == 1


async def test_wrong_tokens_greedy_sends_too_many_wrong_tokens_and_forges_served_by() -> None:
    engine = types.SimpleNamespace(vocab_size=100, decode=lambda ids: f"<{ids[0]}>")
    rogue = Rogue(Mode.WRONG_TOKENS_GREEDY, engine, random.Random(0))
    frames, _ = await _exchange(rogue, _request(), lambda s: rogue._misbehave(s, "ENTRY"), 100)
    chunks = [f for f in frames if isinstance(f, TokenChunk)]
    assert len(chunks) == 4 + EXTRA_TOKENS
    result = frames[-1]
    assert isinstance(result, InferResult) and result.served_by == "ENTRY"


async def test_wrong_tokens_sampled_is_honest_on_greedy_and_implausible_when_sampled(
    tiny_engine: Any,
) -> None:
    from peer.request.admission import Admission
    from peer.request.inference import InferenceService

    rogue = Rogue(Mode.WRONG_TOKENS_SAMPLED, tiny_engine, random.Random(0))
    service = InferenceService(tiny_engine, Admission(4), self_id=PEER, max_inbound_per_peer=4)
    host = types.SimpleNamespace(set_stream_handler=lambda protocol, handler: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve, host)
        serve = lambda s: rogue._sampled_or_honest(s, PEER, service.handle_stream)  # noqa: E731
        prompt = tuple(range(1, 40))
        greedy, _ = await _exchange(rogue, _request(), serve, tiny_engine.vocab_size)
        honest = await tiny_engine.generate(list(prompt), SamplingParams(max_new_tokens=4))
        got = [t for f in greedy if isinstance(f, TokenChunk) for t in f.token_ids]
        assert got == list(honest.token_ids)

        sampled, _ = await _exchange(
            rogue, _request(temperature=0.8, top_p=0.9, seed=1), serve, tiny_engine.vocab_size
        )
        tokens = [t for f in sampled if isinstance(f, TokenChunk) for t in f.token_ids]
        assert len(tokens) == 4
        # Teacher-forced: each token lies outside the nucleus honest sampling draws from.
        with torch.inference_mode():
            ids = torch.tensor([list(prompt) + tokens[:-1]])
            logits = tiny_engine._model(input_ids=ids).logits[0, len(prompt) - 1:]
        for step, token in enumerate(tokens):
            probs = torch.softmax(logits[step].float() / 0.8, dim=-1)
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p
            nucleus = set(order[before < 0.9 + NUCLEUS_MARGIN].tolist())
            assert token not in nucleus
        nursery.cancel_scope.cancel()
    assert rogue.answered == {"honest_greedy": 1, "wrong_sampled": 1}


async def test_sampled_steerer_sends_its_own_draws_which_only_the_seed_check_catches(
    tiny_engine: Any,
) -> None:
    from bench.rogues.sampled_steerer import steered_tokens

    prompt = list(range(1, 40))
    request = _request(temperature=1.0, top_p=1.0, seed=5)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=5)
    steered = await steered_tokens(tiny_engine, request, random.Random(0))
    honest = list((await tiny_engine.generate(prompt, params)).token_ids)
    assert len(steered) == 4 and steered != honest
    # Plausible: the old statistical check (no seed) accepts every steered token...
    unseeded = dataclasses.replace(params, seed=None)
    assert (await tiny_engine.verify(prompt, steered, unseeded)).ok
    # ...the seeded check does not, and accepts the honest answer.
    verdict = await tiny_engine.verify(prompt, steered, params)
    assert not verdict.ok and "is not the one seed 5 selects" in verdict.detail
    assert (await tiny_engine.verify(prompt, honest, params)).ok


def test_bench_json_rows_have_the_reported_keys() -> None:
    args = parse_args(["--json", "/dev/null"])
    assert args.scenarios == list(SCENARIOS)
    honest = [PeerProcess(i + 1, process=None, log_path=None, peer_id=f"H{i}") for i in range(3)]  # type: ignore[arg-type]
    rogue = types.SimpleNamespace(
        peer_ids=["R"], forged_ids=[], received={"R": 1}, answered={}
    )
    route_rogue = [{"peer_id": "R", "tokens": 0}, {"peer_id": "H0", "tokens": 8}]
    rogue_served = [{"peer_id": "R", "tokens": 8}]
    outcomes = [
        Outcome(0, True, "H0", text="ok", served_by="H0", ttft_s=0.1, route=route_rogue),
        Outcome(1, True, "H1", text="bad", served_by="R", ttft_s=0.2, route=rogue_served),
        Outcome(2, True, "H2", text="odd", served_by="H2", ttft_s=0.3, route=[{"peer_id": "H2"}]),
        Outcome(3, True, "H0", text="ok", served_by="H0", ttft_s=0.3, route=[{"peer_id": "H0"}]),
        Outcome(4, False, "H1", error="boom"),
    ]
    for name in ("baseline", *LIARS, "forged_origins"):
        row = summarise(
            name, outcomes, ["ok"] * 5, honest, None if name == "baseline" else rogue, 8
        )
        for key in ("ttft_p50_s", "ttft_p99_s", "requests_ok", "requests_failed",
                    "wrong_outputs_delivered"):
            assert key in row
        assert (row["requests_ok"], row["requests_failed"]) == (4, 1)
        # index 1: a rogue's tokens, wrong; index 2 differs but only H2 served it
        assert row["wrong_outputs_delivered"] == (0 if name == "baseline" else 1)
        assert row["differs_from_reference_served_honestly"] == (2 if name == "baseline" else 1)
        if name in LIARS:
            assert row["requests_until_quarantine"] is None  # until a ledger says otherwise
        if name in ("forged_origins", "sybil"):
            assert "requests_before_proven_per_identity" in row


def test_quarantine_trials_catch_both_liars_through_the_pipeline() -> None:
    from bench.quarantine import LIARS as QUARANTINE_LIARS
    from bench.quarantine import quarantine_trials_sync

    out = quarantine_trials_sync(trials=3, seed=1)
    for driver in ("ledger", "pipeline"):
        for liar in QUARANTINE_LIARS:
            row = out[driver][liar]
            assert row["never_quarantined"] == 0
            assert row["forwards_until_quarantine_max"] >= 1
    # A new identity lies on its first shadow (probation), which is always compared.
    assert out["pipeline"]["always"]["forwards_until_quarantine_max"] == 1
    assert out["pipeline"]["always"]["wrong_outputs_delivered_before_quarantine_max"] == 0


async def test_freeloader_is_a_bare_host_whose_long_requests_the_target_serves(
    tiny_engine: Any,
) -> None:
    from collections import Counter

    from bench.rogues import freeloader
    from peer.config import PeerConfig
    from tests.helpers_swarm import LOOPBACK, start_peer

    base = PeerConfig(model=MODEL, listen_addrs=LOOPBACK, identity_file=None)
    outcomes: Counter[str] = Counter()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            target = await start_peer(nursery, base, tiny_engine)
            async with freeloader.open_client(base) as client:
                assert client.peer_id != target.peer.peer_id
                assert not hasattr(client, "gossip")  # no peer: a host that dials and asks
                loop = trio.CancelScope()

                async def freeload() -> None:
                    with loop:
                        await freeloader.freeload(
                            client, target.peer.multiaddrs[0], tiny_engine.vocab_size,
                            outcomes, random.Random(0),
                        )

                nursery.start_soon(freeload)
                while outcomes["served"] < 2:
                    await trio.sleep(0.1)
                loop.cancel()
            nursery.cancel_scope.cancel()
    assert set(outcomes) == {"served"}  # alone, it finds the engine idle: nothing refused
