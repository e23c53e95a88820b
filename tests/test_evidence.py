"""Signed answers and evidence that travels: a lie signed by its server can be checked
by anyone, and nothing but the accused's own signature over a wrong answer accuses it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.engine.api import Verdict
from peer.request.evidence import EvidenceService
from peer.request.generation import Outcome
from peer.request.signed import evidence_signed
from peer.routing.evidence import Consider, EvidenceDesk, spread_targets
from protocols.answers import Evidence, parse_evidence, request_digest, signed_bytes
from protocols.errors import RemoteProtocolError
from protocols.infer import FinishReason, InferRequest, InferResult
from tests.fake_host import SIGNERS, Step, fake_swarm, honest
from tests.test_pipeline_trust import GOOD, PROMPT, A, B, collect, route, wrong

VOCAB = 1000
REQUEST = InferRequest("r1", (1, 2, 3, 4), max_new_tokens=3, deadline_s=10.0)


def keys(seed: int) -> tuple[str, Any]:
    pair = create_new_key_pair(bytes([seed]) * 32)
    return ID.from_pubkey(pair.public_key).to_base58(), pair.private_key


def signed_evidence(seed: int, answer: tuple[int, ...], accused: str | None = None) -> Evidence:
    signer_id, key = keys(seed)
    accused = accused or signer_id
    signature = key.sign(signed_bytes(accused, REQUEST, answer, FinishReason.LENGTH))
    return Evidence(accused, REQUEST, answer, FinishReason.LENGTH, signature)


def test_the_digest_binds_prompt_sampling_and_id_but_not_the_deadline() -> None:
    same = InferRequest("r1", (1, 2, 3, 4), max_new_tokens=3, deadline_s=99.0, hops=1)
    assert request_digest(same) == request_digest(REQUEST)
    for other in (
        InferRequest("r2", (1, 2, 3, 4), 3, 10.0),
        InferRequest("r1", (1, 2, 3, 5), 3, 10.0),
        InferRequest("r1", (1, 2, 3, 4), 3, 10.0, temperature=0.5, seed=7),
    ):
        assert request_digest(other) != request_digest(REQUEST)
    sampled = InferRequest("r1", (1, 2, 3, 4), 3, 10.0, temperature=0.5, seed=7)
    reseeded = InferRequest("r1", (1, 2, 3, 4), 3, 10.0, temperature=0.5, seed=8)
    assert request_digest(sampled) != request_digest(reseeded)  # the seed picks the tokens


def test_evidence_round_trips_and_its_signature_checks() -> None:
    evidence = signed_evidence(1, (7, 8, 9))
    again = parse_evidence(evidence.to_wire(), VOCAB)
    assert again == evidence and evidence_signed(again)


def test_evidence_cannot_be_forged_against_another_peer() -> None:
    honest_id, _ = keys(2)
    # The forger signs with its own key but names the honest peer as the accused.
    forged = signed_evidence(1, (7, 8, 9), accused=honest_id)
    assert not evidence_signed(forged)
    # A real signature over another answer does not cover a changed one.
    real = signed_evidence(2, (7, 8, 9))
    changed = Evidence(real.accused, REQUEST, (7, 8, 10), FinishReason.LENGTH, real.signature)
    assert not evidence_signed(changed)


@given(st.dictionaries(st.sampled_from(["t", "accused", "request", "answer", "sig",
                                        "finish_reason"]),
                       st.one_of(st.text(max_size=5), st.integers(), st.binary(max_size=8),
                                 st.lists(st.integers(-2, 2000), max_size=4))))
def test_parse_evidence_raises_only_remote_protocol_error(obj: dict[str, Any]) -> None:
    obj.setdefault("t", "evidence")
    with pytest.raises(RemoteProtocolError):
        parse_evidence(obj, VOCAB)


def test_the_desk_checks_each_answer_once_and_bounds_each_sender() -> None:
    desk = EvidenceDesk(self_id="me", max_checking=1, sender_interval_s=5.0)
    assert desk.consider("s", "me", b"d0", 0.0, quarantined=False) is Consider.ABOUT_US
    assert desk.consider("s", "x", b"d0", 0.0, quarantined=True) is (
        Consider.ALREADY_QUARANTINED
    )
    assert desk.consider("s", "x", b"d1", 0.0, quarantined=False) is Consider.CHECK
    assert desk.consider("t", "y", b"d2", 0.0, quarantined=False) is Consider.BUSY
    desk.done()
    assert desk.consider("t", "x", b"d1", 1.0, quarantined=False) is Consider.SEEN
    assert desk.consider("s", "y", b"d2", 1.0, quarantined=False) is (
        Consider.SENDER_TOO_FREQUENT
    )
    assert desk.consider("s", "y", b"d2", 5.0, quarantined=False) is Consider.CHECK


def test_spread_skips_the_accused_ourselves_and_the_source() -> None:
    peers = ["a", "me", "liar", "src", "b", "a"]
    assert spread_targets(peers, accused="liar", self_id="me", source="src") == ["a", "b"]
    assert spread_targets(["p1", "p2", "p3"], accused="x", self_id="me", source=None,
                          limit=2) == ["p1", "p2"]


def _service(verdict_ok: bool, quarantined: list[tuple[str, str]]) -> tuple[
    EvidenceService, list[Any]
]:
    checked: list[Any] = []

    async def verify(prompt: Any, output: Any, params: Any) -> Verdict:
        checked.append((list(prompt), list(output)))
        return Verdict(verdict_ok, None if verdict_ok else 0, "token 0 is wrong", 1)

    service = EvidenceService(
        host=None,  # type: ignore[arg-type]  # check() opens no stream
        self_id="me", vocab_size=VOCAB, verify=verify,
        is_quarantined=lambda peer_id: any(p == peer_id for p, _ in quarantined),
        quarantine=lambda peer_id, reason: quarantined.append((peer_id, reason)),
        peers=lambda: [],
    )
    return service, checked


async def test_signed_evidence_that_rescores_wrong_quarantines_and_is_passed_on() -> None:
    quarantined: list[tuple[str, str]] = []
    service, checked = _service(False, quarantined)
    evidence = signed_evidence(1, (7, 8, 9))
    assert await service.check(evidence, "sender")
    assert [p for p, _ in quarantined] == [evidence.accused]
    assert checked == [([1, 2, 3, 4], [7, 8, 9])]
    assert service._receive.receive_nowait() == (evidence, "sender")  # told onwards
    assert not await service.check(evidence, "other")  # once is enough


async def test_evidence_against_an_honest_answer_or_unsigned_quarantines_nobody() -> None:
    quarantined: list[tuple[str, str]] = []
    service, checked = _service(True, quarantined)
    assert not await service.check(signed_evidence(2, (7, 8, 9)), "sender")
    assert len(checked) == 1  # re-scored: the answer is right
    honest_id, _ = keys(3)
    forged = signed_evidence(1, (5, 5, 5), accused=honest_id)
    await trio.sleep(0)
    assert not await service.check(forged, "sender2")
    assert len(checked) == 1  # the signature failed first: no re-scoring spent
    assert quarantined == []
    assert service.statistics()["evidence_unsigned"] == 1


async def test_a_verified_lie_yields_evidence_signed_by_the_liar(autojump_clock: Any) -> None:
    swarm = fake_swarm({A: (7, wrong), B: (6, honest())}, PROMPT, verify_fraction=1.0)
    found: list[Evidence] = []
    swarm.pipeline._context._on_evidence = found.append
    _, result = await collect(swarm.pipeline)
    assert route(result) == [(A, Outcome.WRONG_OUTPUT), (B, Outcome.OK)]
    assert len(found) == 1 and found[0].accused == A and A in SIGNERS
    assert list(found[0].answer) == [(t + 1) % VOCAB for t in GOOD]
    assert list(found[0].request.prompt_token_ids) == PROMPT
    assert evidence_signed(found[0])


async def test_an_answer_not_signed_by_its_server_is_a_fault(autojump_clock: Any) -> None:
    def forger(request: InferRequest) -> list[Step]:
        steps = honest()(request)
        result = steps[-1].frame
        assert isinstance(result, InferResult)
        return [*steps[:-1], Step(0.0, replace(result, signature=b"\x01" * 64))]

    swarm = fake_swarm({A: (8, forger), B: (6, honest())}, PROMPT)
    _, result = await collect(swarm.pipeline)
    assert not swarm.trust.routable(A)
    assert "not signed" in swarm.trust.view(A).reason
    assert list(result.token_ids) == GOOD  # every token came before the result


async def test_evidence_arrives_over_a_stream_and_a_garbage_frame_is_counted() -> None:
    from protocols.framing import encode_frame
    from tests.test_remote_serving import _Pipe

    quarantined: list[tuple[str, str]] = []
    service, _ = _service(False, quarantined)
    evidence = signed_evidence(4, (1, 2, 3))
    for payload in (evidence.to_wire(), {"t": "evidence", "accused": 5}):
        ours, theirs = trio.testing.memory_stream_pair()
        await ours.send_all(encode_frame(payload))
        await ours.aclose()
        await service._receive_one(_Pipe(theirs), "sender")  # type: ignore[arg-type]
    assert [p for p, _ in quarantined] == [evidence.accused]
    assert service.statistics()["evidence_invalid"] == 1


async def test_an_audit_rescores_a_delivered_answer_and_a_wrong_one_is_a_confirmed_lie() -> None:
    from peer.request.evidence import AUDITS

    quarantined: list[tuple[str, str]] = []
    service, checked = _service(False, quarantined)
    lie = signed_evidence(1, (7, 8, 9))
    assert service.audit(lie)
    for n in range(AUDITS - 1):
        assert service.audit(signed_evidence(1, (n,)))
    assert not service.audit(signed_evidence(1, (5,)))  # bounded: dropped and counted
    assert service.statistics()["audits_dropped"] == 1
    service._audit_send.close()
    await service._audits()  # the audit task, as serve() runs it, until none wait
    assert len(checked) == AUDITS
    assert quarantined[0][0] == lie.accused and "audited after delivery" in quarantined[0][1]
    assert service._receive.receive_nowait() == (lie, None)  # told to the table
    assert service.statistics()["audits_failed"] == AUDITS


async def test_a_newly_trusted_peers_answer_is_delivered_then_handed_to_an_audit(
    autojump_clock: Any,
) -> None:
    swarm = fake_swarm({A: (7, wrong), B: (6, honest())}, PROMPT, verify_fraction=1e-12)
    audits: list[Evidence] = []
    swarm.pipeline._context._on_audit = lambda evidence: audits.append(evidence) or True
    _, result = await collect(swarm.pipeline)
    assert route(result) == [(A, Outcome.OK)]  # not held back: the client has it at once
    assert [e.accused for e in audits] == [A] and evidence_signed(audits[0])
    assert swarm.trust.statistics()["audited"] == 1
    for _ in range(2):
        await collect(swarm.pipeline)
    assert len(audits) == 3 and not swarm.trust.should_audit(A)  # the first three only


async def test_an_audit_waits_for_the_engine_to_be_idle_but_not_forever(
    autojump_clock: Any,
) -> None:
    from peer.request.evidence import AUDIT_IDLE_WAIT_S

    quarantined: list[tuple[str, str]] = []
    service, checked = _service(True, quarantined)
    busy_until = 5.0
    service._idle = lambda: trio.current_time() >= busy_until
    assert service.audit(signed_evidence(1, (7, 8, 9)))
    service._audit_send.close()
    start = trio.current_time()
    await service._audits()
    assert checked and trio.current_time() >= busy_until  # ran once idle
    service2, checked2 = _service(True, quarantined)
    service2._idle = lambda: False  # never idle: the audit still runs, late
    assert service2.audit(signed_evidence(1, (7,)))
    service2._audit_send.close()
    start = trio.current_time()
    await service2._audits()
    assert checked2 and trio.current_time() - start >= AUDIT_IDLE_WAIT_S - 1e-6
    assert service2.statistics()["audits_run_busy"] == 1
    assert quarantined == []  # both answers re-scored right
