"""Serving: what a peer does with requests, assembled from its parts.

One `Admission` bounds the local engine's queue for requests from anywhere; the
`InferenceService` answers forwarded requests; the `Pipeline` routes this peer's own
requests through the `Router`; the `RequestLog` keeps the last ones that ended, with
their routes. `Serving` is the peer's `GenerationService` (peer/request/generation.py): the HTTP
face and `Peer.generate()` call `prepare` once, then `run`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from peer.config import PeerConfig
from peer.engine.api import EngineLoad, GeneratingEngine, SamplingParams
from peer.net.wire import HandlerHost, StreamOpener
from peer.request.admission import Admission, Overloaded
from peer.request.budget import BudgetPolicy, RemoteBudget
from peer.request.evidence import EvidenceService
from peer.request.generation import (
    DeadlineExceeded,
    GenerationItem,
    GenerationRequest,
    GenerationResult,
    GenerationService,
    Prompt,
    RequestFailed,
)
from peer.request.inference import InferenceService
from peer.request.pipeline import Pipeline
from peer.request.request_log import RequestLog, RequestOutcome, RequestRecord, route_of
from peer.request.served_log import ServedLog
from peer.request.served_service import ServedService, served_elsewhere
from peer.request.signed import Signer
from peer.routing.probe_service import LoadService
from peer.routing.router import build_router
from peer.routing.trust import (
    Quarantine,
    QuarantineRecord,
    TrustLedger,
    dump_quarantine,
    parse_quarantine,
)
from peer.swarm.peer_table import PeerTable
from protocols.served import ServedQuery, prompt_digest

if TYPE_CHECKING:  # trio's TaskStatus, as the trio-stubs py-libp2p pulls in type it
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05  # how often a drain looks whether the requests in flight ended

__all__ = ["Prompt", "Serving", "load_quarantine"]

# A probation answer's check (protocols/served.py): peers asked whether the probation peer
# asked them for the prompt, and how long the check may take (it delays only the credit).
MAX_SERVED_ASKED = 4
SERVED_QUERY_TIMEOUT_S = 2.0


class Serving:
    """Requests in and out of one peer: its GenerationService."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        engine: GeneratingEngine,
        table: PeerTable,
        host: StreamOpener,
        self_id: str,
        rng: random.Random | None = None,
        before_route: Callable[[Sequence[int], Sequence[int], float], Awaitable[None]]
        | None = None,
        sign: Signer | None = None,
    ) -> None:
        self.engine = engine
        self.admission = Admission(config.max_queue, name="engine queue")
        self._quarantine_path = config.quarantine_path
        self.trust = TrustLedger(
            verify_fraction=config.verify_fraction,
            probation_requests=config.probation_requests,
            can_verify=engine.verify is not None,
            quarantined=load_quarantine(self._quarantine_path),
        )
        self.router = build_router(
            config.policy, rng or random.Random(), block_size=engine.block_size, trust=self.trust
        )
        self._host = host
        self._table = table
        self._self_id = self_id
        self.served_log = ServedLog()  # who asked for which prompt (protocols/served.py)
        self.served = ServedService(self.served_log)
        self.inference = InferenceService(
            engine,
            self.admission,
            self_id=self_id,
            max_inbound_per_peer=config.max_inbound_per_peer,
            budget=RemoteBudget(
                BudgetPolicy(
                    identity_share=config.identity_share, remote_share=config.remote_share
                )
            ),
            refuses=lambda peer_id: not self.trust.routable(peer_id),
            trusted=lambda peer_id: (
                self.trust.routable(peer_id) and not self.trust.on_probation(peer_id)
            ),
            sign=sign,
            served_log=self.served_log,
        )
        self.load = LoadService(engine)  # answers other entry peers' load probes
        self.pipeline = Pipeline(
            config=config,
            engine=engine,
            router=self.router,
            table=table,
            host=host,
            admission=self.admission,
            self_id=self_id,
            trust=self.trust,
            rng=rng,
            on_quarantine=self._persist_quarantine,
            on_evidence=lambda evidence: self.evidence.spread(evidence),
            on_audit=lambda evidence: self.evidence.audit(evidence),
            before_route=before_route,
            served_elsewhere=self._served_elsewhere,
        )
        # Told of lies other peers verified; tells them of ours (peer/request/evidence.py).
        self.evidence = EvidenceService(
            host=host, self_id=self_id, vocab_size=engine.vocab_size, verify=engine.verify,
            is_quarantined=lambda peer_id: not self.trust.routable(peer_id),
            quarantine=self.pipeline.quarantine,
            peers=lambda: [v.peer_id for v in table.views(trio.current_time())],
            idle=lambda: _idle(engine.load()),
        )
        self.requests = RequestLog()

    async def _served_elsewhere(self, peer_id: str, prompt: Sequence[int]) -> str | None:
        """A peer (this one included) that says `peer_id` asked it for `prompt` lately: its
        answer was obtained there, not computed. Asks at most MAX_SERVED_ASKED others at
        once, those past probation first, within SERVED_QUERY_TIMEOUT_S."""
        digest = prompt_digest(prompt)
        now = trio.current_time()
        if self.served_log.asked(digest, peer_id, now):
            return self._self_id
        trust = self.trust
        others = [v.peer_id for v in self._table.views(now)
                  if v.peer_id != peer_id and trust.routable(v.peer_id)]
        others.sort(key=trust.on_probation)  # stable: past probation first, then by id
        asked = others[:MAX_SERVED_ASKED]
        if not asked:
            return None
        return await served_elsewhere(self._host, asked, ServedQuery(digest, peer_id),
                                      SERVED_QUERY_TIMEOUT_S, self.pipeline.stats)

    def _persist_quarantine(self, action: Quarantine) -> None:
        """Write every quarantine record (wall-clock times) next to the identity key."""
        path = self._quarantine_path
        if path is None:
            return
        records = [
            r._replace(at=time.time()) if r.peer_id == action.peer_id else r
            for r in self.trust.quarantine_records()
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(dump_quarantine(records))
            os.replace(tmp, path)
        except OSError as exc:  # the quarantine holds in memory; say the file failed
            logger.error("could not persist the quarantine to %s: %s", path, exc)

    async def serve(
        self,
        libp2p_host: HandlerHost,
        *,
        task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer forwarded requests and load probes, and own the shadows sent to peers
        on probation, until cancelled."""
        self.load.serve(libp2p_host)
        self.served.serve(libp2p_host)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.pipeline.shadows.serve)
            await nursery.start(self.evidence.serve, libp2p_host)
            await nursery.start(self.inference.serve, libp2p_host)
            task_status.started()

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def in_flight(self) -> int:
        """Requests running here now: entered here (HTTP, the library) or forwarded here."""
        return self.pipeline.entry_in_flight + self.inference.in_flight

    async def drain(self, timeout_s: float) -> int:
        """Refuse forwarded requests from now on and wait, up to `timeout_s`, until those
        in flight have ended; the requests still running then (0 when drained)."""
        self.inference.stop_accepting()
        with trio.move_on_after(timeout_s):
            while self.in_flight:
                await trio.sleep(DRAIN_POLL_S)
        return self.in_flight

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, of chat messages (chat template), or ids as given."""
        if isinstance(prompt, str):
            return self.engine.encode_prompt(prompt)
        items = list(prompt)
        if items and all(isinstance(t, dict) for t in items):
            return self.engine.encode_prompt(items)  # type: ignore[arg-type]
        return items  # type: ignore[return-value]  # token ids: validate() checks them

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: bytes | None = None,
        timeout_s: float | None = None,
    ) -> GenerationRequest:
        """The request checked once, here: tokenised, ids in the vocabulary, sampling
        limits, prompt + max_new_tokens within the context (InvalidRequest, or its
        ContextTooLong, otherwise)."""
        tokens = self.engine.validate(self.encode(prompt), params)
        return GenerationRequest(
            request_id=request_id or uuid.uuid4().hex,
            token_ids=tuple(tokens),
            params=params,
            cache_salt=cache_salt,
            timeout_s=timeout_s,
        )

    async def run(self, request: GenerationRequest) -> AsyncGenerator[GenerationItem, None]:
        """Chunks as they are generated, then the GenerationResult (see Pipeline.stream).

        Every request run ends in `self.requests`."""
        ended = False
        try:
            async with contextlib.aclosing(self.pipeline.stream(request)) as items:
                async for item in items:
                    if isinstance(item, GenerationResult):
                        self.requests.record(_ok_record(item, trio.current_time()))
                        ended = True
                    yield item
        except (RequestFailed, Overloaded) as exc:
            outcome = (
                RequestOutcome.DEADLINE if isinstance(exc, DeadlineExceeded)
                else RequestOutcome.FAILED if isinstance(exc, RequestFailed)
                else RequestOutcome.OVERLOADED
            )
            ended = True
            self.requests.record(
                RequestRecord(
                    request.request_id, trio.current_time(), outcome, len(request.token_ids),
                    route=route_of(getattr(exc, "attempts", ())), error=str(exc),
                )
            )
            raise
        finally:
            if not ended:  # cancelled, or closed by its consumer before the end
                self.requests.record(
                    RequestRecord(
                        request.request_id, trio.current_time(), RequestOutcome.CANCELLED,
                        len(request.token_ids),
                    )
                )

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: bytes | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[GenerationItem, None]:
        """prepare() then run(): for programs and tests holding a prompt. Raises
        InvalidRequest before anything runs."""
        request = self.prepare(
            prompt, params or SamplingParams(), request_id=request_id, cache_salt=cache_salt,
            timeout_s=timeout_s,
        )
        async with contextlib.aclosing(self.run(request)) as items:
            async for item in items:
                yield item

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: bytes | None = None,
        timeout_s: float | None = None,
    ) -> GenerationResult:
        agen = self.stream(
            prompt, params, request_id=request_id, cache_salt=cache_salt, timeout_s=timeout_s
        )
        async with contextlib.aclosing(agen) as items:
            async for item in items:
                if isinstance(item, GenerationResult):
                    return item
        raise RuntimeError("pipeline ended without a result")  # unreachable by construction

    def statistics(self) -> dict[str, Any]:
        return {
            "admission": self.admission.statistics(),
            "pipeline": self.pipeline.statistics(),
            "inference": self.inference.statistics(),
            "evidence": self.evidence.statistics(),
            "load_probe": self.load.statistics(),
            "served_for": self.served.statistics(),
            "router": self.router.statistics()._asdict(),
            "forward_overhead": self.router.forward_overhead.statistics(),
            "probe_waits": self.router.probe_waits.statistics(),
            "trust": self.trust.statistics(),
            "requests": self.requests.statistics(),
        }


if TYPE_CHECKING:  # make lint checks that Serving implements the service's Protocol

    def _is_a_generation_service(serving: Serving) -> GenerationService:
        return serving


def load_quarantine(path: Path | None) -> list[QuarantineRecord]:
    """Quarantined peers persisted at ``path`` (none if absent); ValueError if unreadable."""
    if path is None or not path.exists():
        return []
    try:
        return parse_quarantine(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"quarantine file {path}: {exc}") from exc


def _ok_record(result: GenerationResult, now: float) -> RequestRecord:
    return RequestRecord(
        request_id=result.request_id,
        ended_at=now,
        outcome=RequestOutcome.OK,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        completion_tokens=result.completion_tokens,
        ttft_s=result.ttft_s,
        total_s=result.total_s,
        served_by=result.served_by,
        route=route_of(result.route),
    )


def _idle(load: EngineLoad) -> bool:
    return load.running_requests == 0 and load.waiting_requests == 0
