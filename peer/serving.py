"""Serving: what a peer does with requests, assembled from its parts.

One `Admission` bounds the local engine's queue for requests from anywhere; the
`InferenceService` answers forwarded requests; the `Pipeline` routes this peer's own
requests through the `Router`. `Peer.generate()` and the HTTP API call `Serving`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import trio

from peer.admission import Admission
from peer.config import PeerConfig
from peer.engine.api import SamplingParams
from peer.inference import InferenceService
from peer.pipeline import GenerationChunk, GenerationResult, Pipeline
from peer.router import Router

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
        self.router = Router(config.policy, rng or random.Random(), block_size=engine.block_size)
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
        )

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
        }
