"""Serving: what a peer does with requests, assembled from its parts.

One `Admission` bounds the local engine's queue for requests from anywhere; the
`InferenceService` answers forwarded requests; the `Pipeline` routes this peer's own
requests through the `Router`; the `RequestLog` keeps the last ones that ended, with
their routes. `Peer.generate()` and the HTTP API call `Serving`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import trio

from peer.admission import Admission, Overloaded
from peer.config import PeerConfig
from peer.engine.api import InvalidRequest, SamplingParams
from peer.inference import InferenceService
from peer.load_probe import LoadService
from peer.pipeline import (
    DeadlineExceeded,
    GenerationChunk,
    GenerationResult,
    Pipeline,
    RequestFailed,
)
from peer.request_log import RequestLog, RequestOutcome, RequestRecord, route_of
from peer.router import Router
from peer.trust import (
    Quarantine,
    QuarantineRecord,
    TrustLedger,
    dump_quarantine,
    parse_quarantine,
)

logger = logging.getLogger(__name__)

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


class Serving:
    """Requests in and out of one peer."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        engine: Any,
        table: Any,
        host: Any,
        self_id: str,
        rng: random.Random | None = None,
    ) -> None:
        self.engine = engine
        self.admission = Admission(config.max_queue, name="engine queue")
        self._quarantine_path = config.quarantine_path
        self.trust = TrustLedger(
            verify_fraction=config.verify_fraction,
            probation_requests=config.probation_requests,
            probation_share=config.probation_share,
            can_verify=callable(getattr(engine, "verify", None)),
            quarantined=load_quarantine(self._quarantine_path),
        )
        self.router = Router(
            config.policy,
            rng or random.Random(),
            block_size=engine.block_size,
            trust=self.trust,
            require_rtt=True,
        )
        self.inference = InferenceService(
            engine,
            self.admission,
            self_id=self_id,
            max_inbound_per_peer=config.max_inbound_per_peer,
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
        )
        self.requests = RequestLog()

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

    async def serve(self, libp2p_host: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Answer forwarded requests and load probes until cancelled."""
        self.load.serve(libp2p_host)
        await self.inference.serve(libp2p_host, task_status=task_status)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, of chat messages (chat template), or ids as given."""
        if isinstance(prompt, str):
            return self.engine.encode_prompt(prompt)  # type: ignore[no-any-return]
        items = list(prompt)
        if items and all(isinstance(t, dict) for t in items):
            return self.engine.encode_prompt(items)  # type: ignore[no-any-return]
        return items  # type: ignore[return-value]  # token ids: the engine validates them

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> AsyncGenerator[GenerationChunk | GenerationResult, None]:
        """Chunks as they are generated, then the GenerationResult (see Pipeline.stream).

        Every request that gets past validation ends in `self.requests`."""
        tokens = self.encode(prompt)
        request_id = kwargs.pop("request_id", None) or uuid.uuid4().hex
        agen = self.pipeline.stream(
            tokens, params or SamplingParams(), request_id=request_id, **kwargs
        )
        ended = False
        try:
            async with contextlib.aclosing(agen):
                async for item in agen:
                    if isinstance(item, GenerationResult):
                        self.requests.record(_ok_record(item, trio.current_time()))
                        ended = True
                    yield item
        except InvalidRequest:
            ended = True  # bad input: nothing was routed, nothing to show
            raise
        except (RequestFailed, Overloaded) as exc:
            outcome = (
                RequestOutcome.DEADLINE if isinstance(exc, DeadlineExceeded)
                else RequestOutcome.FAILED if isinstance(exc, RequestFailed)
                else RequestOutcome.OVERLOADED
            )
            ended = True
            self.requests.record(
                RequestRecord(
                    request_id, trio.current_time(), outcome, len(tokens),
                    route=route_of(getattr(exc, "attempts", ())), error=str(exc),
                )
            )
            raise
        finally:
            if not ended:  # cancelled, or closed by its consumer before the end
                self.requests.record(
                    RequestRecord(
                        request_id, trio.current_time(), RequestOutcome.CANCELLED, len(tokens)
                    )
                )

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> GenerationResult:
        async with contextlib.aclosing(self.stream(prompt, params, **kwargs)) as items:
            async for item in items:
                if isinstance(item, GenerationResult):
                    return item
        raise RuntimeError("pipeline ended without a result")  # unreachable by construction

    def statistics(self) -> dict[str, Any]:
        return {
            "admission": self.admission.statistics(),
            "pipeline": self.pipeline.statistics(),
            "inference": self.inference.statistics(),
            "load_probe": self.load.statistics(),
            "router": self.router.statistics()._asdict(),
            "trust": self.trust.statistics(),
            "requests": self.requests.statistics(),
        }


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
