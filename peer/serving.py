"""Serving: what a peer does with requests, assembled from its parts.

One `Admission` bounds the local engine's queue for requests from anywhere; the
`InferenceService` answers forwarded requests; the `Pipeline` routes this peer's own
requests through the `Router`. `Peer.generate()` and the HTTP API call `Serving`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import trio

from peer.admission import Admission
from peer.config import PeerConfig
from peer.engine.engine import SamplingParams
from peer.inference import InferenceService
from peer.pipeline import GenerationChunk, GenerationResult, Pipeline
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
        """Answer forwarded requests until cancelled."""
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
        """Chunks as they are generated, then the GenerationResult (see Pipeline.stream)."""
        tokens = self.encode(prompt)
        agen = self.pipeline.stream(tokens, params or SamplingParams(), **kwargs)
        async with contextlib.aclosing(agen):
            async for item in agen:
                yield item

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> GenerationResult:
        tokens = self.encode(prompt)
        return await self.pipeline.generate(tokens, params or SamplingParams(), **kwargs)

    def statistics(self) -> dict[str, Any]:
        return {
            "admission": self.admission.statistics(),
            "pipeline": self.pipeline.statistics(),
            "inference": self.inference.statistics(),
            "router": self.router.statistics()._asdict(),
            "trust": self.trust.statistics(),
        }


def load_quarantine(path: Path | None) -> list[QuarantineRecord]:
    """Quarantined peers persisted at ``path`` (none if absent); ValueError if unreadable."""
    if path is None or not path.exists():
        return []
    try:
        return parse_quarantine(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"quarantine file {path}: {exc}") from exc
