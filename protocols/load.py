"""The load-probe protocol /prefixswarm/load/1.0.0: one query, one report, one stream.

An entry peer about to forward asks a few candidates for their load now
(peer/routing/probing.py decides whom): one ``LoadQuery``, one ``LoadReport`` with the
figures a summary carries. A report is a claim, bounded here and weighed by the asker's
trust rules. Parsers raise only ``RemoteProtocolError``; unknown keys are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.errors import RemoteProtocolError
from protocols.framing import message_map
from protocols.ids import validate_model_id

__all__ = [
    "KIND_LOAD_QUERY",
    "KIND_LOAD_REPORT",
    "LOAD_VERSION",
    "MAX_LOAD_COUNT",
    "MAX_LOAD_FRAME_BYTES",
    "LoadQuery",
    "LoadReport",
    "decode_load_query",
    "decode_load_report",
]

LOAD_VERSION = 1
KIND_LOAD_QUERY = "load_query"
KIND_LOAD_REPORT = "load_report"
# A report is a handful of small ints (~80 bytes of CBOR); 1 KiB refuses anything else.
MAX_LOAD_FRAME_BYTES = 1024
# The same bound as a summary's counts (protocols/summary.py MAX_COUNT): far beyond any
# queue, and sums over all peers stay exact in a float.
MAX_LOAD_COUNT = 1 << 40


def _check_count(name: str, value: object) -> None:
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_LOAD_COUNT:
        raise ValueError(f"{name} must be in [0, {MAX_LOAD_COUNT}], got {value}")


def _check_model_id(model_id: object) -> None:
    if model_id != "":
        validate_model_id(model_id)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LoadQuery:
    """What is your load now? The asker's model id ('' unsaid) lets the answering peer see
    a peer of another model knocking (a misconfigured join)."""

    model_id: str = ""

    def __post_init__(self) -> None:
        _check_model_id(self.model_id)

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {"t": KIND_LOAD_QUERY, "v": LOAD_VERSION}
        if self.model_id:
            wire["model_id"] = self.model_id
        return wire


@dataclass(frozen=True)
class LoadReport:
    """A peer's load as its engine reports it (peer/engine/api.py EngineLoad)."""

    queued_prompt_tokens: int  # prompt tokens admitted and not yet prefilled
    running_requests: int  # requests admitted and not yet finished
    waiting_requests: int = 0  # not yet in the batch (a batching engine); informational
    model_id: str = ""  # the model this peer serves ('' from peers that do not say)

    def __post_init__(self) -> None:
        _check_count("queued_prompt_tokens", self.queued_prompt_tokens)
        _check_count("running_requests", self.running_requests)
        _check_count("waiting_requests", self.waiting_requests)
        _check_model_id(self.model_id)

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {
            "t": KIND_LOAD_REPORT,
            "v": LOAD_VERSION,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "running_requests": self.running_requests,
            "waiting_requests": self.waiting_requests,
        }
        if self.model_id:
            wire["model_id"] = self.model_id
        return wire


def _mapping(obj: object, kind: str) -> dict[object, object]:
    return message_map(obj, kind, LOAD_VERSION, "load")


def decode_load_query(obj: object) -> LoadQuery:
    """A query from a decoded frame (the answering side's first frame)."""
    mapping = _mapping(obj, KIND_LOAD_QUERY)
    try:
        return LoadQuery(model_id=mapping.get("model_id", ""))  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"invalid load query: {exc}") from exc


def decode_load_report(obj: object) -> LoadReport:
    """A report from a decoded frame; RemoteProtocolError for anything invalid."""
    mapping = _mapping(obj, KIND_LOAD_REPORT)
    try:
        return LoadReport(
            queued_prompt_tokens=mapping["queued_prompt_tokens"],  # type: ignore[arg-type]
            running_requests=mapping["running_requests"],  # type: ignore[arg-type]
            waiting_requests=mapping.get("waiting_requests", 0),  # type: ignore[arg-type]
            model_id=mapping.get("model_id", ""),  # type: ignore[arg-type]
        )
    except KeyError as exc:
        raise RemoteProtocolError(f"load report lacks {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"invalid load report: {exc}") from exc
