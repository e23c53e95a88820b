"""Evidence that travels: a verified lie is told to other peers, who check it themselves.

When this peer verifies a forwarded answer as wrong, it quarantines the liar and sends
the liar's signed answer and the request (protocols/answers.py `Evidence`) to the peers
in its table over /prefixswarm/evidence/1.0.0. A peer receiving it admits it through its
`EvidenceDesk` (bounded, deduplicated, one check per sender per interval), checks the
accused's signature, then re-scores the answer with its own engine's verifier; only a
signed answer its own verifier rejects quarantines the accused here, and then it tells
its own table in turn. One entry's discovery thus protects the swarm, and nobody can be
accused with an answer it did not sign or that is right.

Audits are this peer's own checks after delivery (peer/routing/trust.py `should_audit`):
a newly trusted peer's signed answer, already streamed to the client, is re-scored here
one at a time, when the engine is idle (or after AUDIT_IDLE_WAIT_S), at most AUDITS
waiting (more are dropped and counted), and a wrong one is handled as a confirmed lie:
quarantine, then evidence to the table.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from peer.engine.api import EngineError, SamplingParams, Verdict, Verify
from peer.net.wire import FrameStream, HandlerHost, InboundStream, StreamOpener, WireError
from peer.request.signed import evidence_signed
from peer.routing.evidence import Consider, EvidenceDesk, spread_targets
from peer.routing.trust import AUDITS_WAITING
from protocols.answers import Evidence, parse_evidence
from protocols.errors import RemoteProtocolError
from protocols.ids import EVIDENCE_PROTOCOL

if TYPE_CHECKING:  # trio's TaskStatus, as the trio-stubs py-libp2p pulls in type it
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a sender writes its one frame right after opening
SEND_TIMEOUT_S = 10.0  # per peer told: open, write, close
OUTBOX = 16  # confirmed lies waiting to be told; beyond it the oldest news is dropped
AUDITS = AUDITS_WAITING  # delivered answers waiting for their audit; beyond: dropped
AUDIT_IDLE_WAIT_S = 30.0  # an audit waits this long at most for the engine to be idle
AUDIT_IDLE_POLL_S = 0.1


class EvidenceService:
    """Receives, checks and passes on evidence of lies; tells others of our own finds."""

    def __init__(
        self,
        *,
        host: StreamOpener,
        self_id: str,
        vocab_size: int,
        verify: Verify | None,
        is_quarantined: Callable[[str], bool],
        quarantine: Callable[[str, str], None],
        peers: Callable[[], Iterable[str]],
        desk: EvidenceDesk | None = None,
        idle: Callable[[], bool] = lambda: True,
    ) -> None:
        self._host = host
        self._self_id = self_id
        self._vocab_size = vocab_size
        self._verify = verify
        self._is_quarantined = is_quarantined
        self._quarantine = quarantine
        self._peers = peers
        self.desk = desk or EvidenceDesk(self_id=self_id)
        self._idle = idle  # whether the engine serves nothing now (audits wait for it)
        self._send, self._receive = trio.open_memory_channel[tuple[Evidence, str | None]](
            OUTBOX
        )
        self._audit_send, self._audit_receive = trio.open_memory_channel[Evidence](AUDITS)
        self.stats: Counter[str] = Counter()

    def audit(self, evidence: Evidence) -> bool:
        """Re-score this delivered, signed answer soon (False: too many waiting)."""
        try:
            self._audit_send.send_nowait(evidence)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.stats["audits_dropped"] += 1
            return False
        return True

    def spread(self, evidence: Evidence, source: str | None = None) -> None:
        """Tell the peers in our table of this lie (not `source`, who told us)."""
        try:
            self._send.send_nowait((evidence, source))
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.stats["evidence_outbox_full"] += 1

    async def serve(
        self, host: HandlerHost, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Answer the evidence protocol and tell others, until cancelled."""
        async with trio.open_nursery() as nursery, self._receive:

            async def handle(stream: InboundStream) -> None:
                sender = stream.muxed_conn.peer_id.to_base58()
                nursery.start_soon(self._receive_one, stream, sender)

            host.set_stream_handler(TProtocol(EVIDENCE_PROTOCOL), handle)
            nursery.start_soon(self._audits)
            task_status.started()
            async for evidence, source in self._receive:
                targets = spread_targets(
                    self._peers(), accused=evidence.accused, self_id=self._self_id,
                    source=source,
                )
                for peer in targets:
                    nursery.start_soon(self._tell, peer, evidence)

    async def _audits(self) -> None:
        async with self._audit_receive:
            async for evidence in self._audit_receive:
                await self._wait_idle()
                verdict = await self._rescore(evidence, "audit")
                if verdict is None:
                    continue
                self.stats["audits_passed" if verdict.ok else "audits_failed"] += 1
                if not verdict.ok:
                    self._quarantine(evidence.accused,
                                     f"wrong output (audited after delivery): {verdict.detail}")
                    self.spread(evidence)

    async def _wait_idle(self) -> None:
        """Until the engine serves nothing, for AUDIT_IDLE_WAIT_S at most: an audit is
        nobody's request, so it takes the engine's idle time where there is some (a busy
        entry still audits, late, rather than never)."""
        with trio.move_on_after(AUDIT_IDLE_WAIT_S) as waited:
            while not self._idle():
                await trio.sleep(AUDIT_IDLE_POLL_S)
        if waited.cancelled_caught:
            self.stats["audits_run_busy"] += 1

    async def _rescore(self, evidence: Evidence, what: str) -> Verdict | None:
        """Our own verifier's verdict on the signed answer (None: no verifier, or it
        failed)."""
        if self._verify is None:  # nothing to re-score with: believe no one
            self.stats[f"{what}_unverifiable"] += 1
            return None
        request = evidence.request
        params = SamplingParams(
            max_new_tokens=request.max_new_tokens, temperature=request.temperature,
            top_p=request.top_p, seed=request.seed, stop=request.stop,
        )
        try:
            return await self._verify(
                list(request.prompt_token_ids), list(evidence.answer), params
            )
        except (EngineError, ValueError, RuntimeError) as exc:
            self.stats[f"{what}_check_failed"] += 1
            logger.info("could not re-score an answer of %s: %s", evidence.accused, exc)
            return None

    async def _tell(self, peer: str, evidence: Evidence) -> None:
        with trio.move_on_after(SEND_TIMEOUT_S):
            try:
                stream = await self._host.new_stream(
                    ID.from_base58(peer), [EVIDENCE_PROTOCOL], timeout_s=SEND_TIMEOUT_S
                )
                frames = FrameStream(stream)
                await frames.send(evidence)
                await frames.close()
                self.stats["evidence_sent"] += 1
                return
            except (WireError, ValueError) as exc:
                logger.debug("could not tell %s of a lie: %s", peer, exc)
        self.stats["evidence_send_failed"] += 1

    async def _receive_one(self, stream: InboundStream, sender: str) -> None:
        frames = FrameStream(stream)
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                evidence = parse_evidence(await frames.receive(), self._vocab_size)
        except (RemoteProtocolError, WireError, trio.TooSlowError) as exc:
            self.stats["evidence_invalid"] += 1
            logger.info("bad evidence from %s: %s", sender, exc)
            return
        finally:
            with contextlib.suppress(WireError):
                await frames.close()
        await self.check(evidence, sender)

    async def check(self, evidence: Evidence, sender: str) -> bool:
        """Check `evidence` from `sender`; True when it quarantined the accused here."""
        accused = evidence.accused
        admitted = self.desk.consider(
            sender, accused, evidence.signed_bytes(), trio.current_time(),
            quarantined=self._is_quarantined(accused),
        )
        self.stats[f"evidence_{admitted.value}"] += 1
        if admitted is not Consider.CHECK:
            return False
        try:
            if not evidence_signed(evidence):
                self.stats["evidence_unsigned"] += 1
                return False
            verdict = await self._rescore(evidence, "evidence")
            if verdict is None:
                return False
            if verdict.ok:
                self.stats["evidence_rejected"] += 1
                logger.warning("evidence from %s against %s does not hold up", sender, accused)
                return False
            self.stats["evidence_confirmed"] += 1
            self._quarantine(accused, f"signed wrong answer, reported by {sender[:16]}: "
                                      f"{verdict.detail}")
            self.spread(evidence, source=sender)
            return True
        finally:
            self.desk.done()

    def statistics(self) -> dict[str, int]:
        stats = dict(self.stats)
        stats["evidence_checking"] = self.desk.checking
        return stats
