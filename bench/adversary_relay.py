"""bench.adversary's relay_impersonator scenario: the swarm shape that forces relaying,
and what the relay saw (bench/rogues/relay_impersonator.py dumps every forwarded byte).

Shape: the same 3 honest peers and the rogue, on loopback, but peers 2 and 3 listen on
nothing (outbound only, as behind two NATs: neither can dial the other) and peer 1
relays for nobody (`--no-relay-service`), so every stream between peers 2 and 3 goes
through the rogue, the one relay that reachable peers offer. No namespaces are needed:
an outbound-only peer is reachable only through a relay.

Measured from inside the relay: windows of every prompt's token ids as the inference
protocol encodes them (CBOR, WINDOW_TOKENS consecutive ids) and of every reference
answer's text (WINDOW_CHARS characters) are searched for in the forwarded bytes; the
same search over a plaintext frame finds them (tests/test_adversary_relay.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from protocols.framing import encode_cbor

SCENARIO = "relay_impersonator"
WINDOW_TOKENS = 8  # consecutive prompt token ids: 8-24 bytes of CBOR, never by chance
WINDOW_CHARS = 16  # characters of an answer's text
NO_RELAY = ("--no-relay-service",)
OUTBOUND_ONLY = "none"  # --listen none


def honest_shape(index: int) -> tuple[str, tuple[str, ...]]:
    """(listen address, extra serve options) of honest peer `index` in this scenario."""
    if index == 0:
        return "/ip4/127.0.0.1/tcp/0", NO_RELAY
    return OUTBOUND_ONLY, ()


def token_windows(prompt: Sequence[int]) -> list[bytes]:
    """Non-overlapping WINDOW_TOKENS-id windows of a prompt as CBOR array items."""
    encoded = [encode_cbor(t) for t in prompt]
    return [b"".join(encoded[i:i + WINDOW_TOKENS])
            for i in range(0, len(encoded) - WINDOW_TOKENS + 1, WINDOW_TOKENS)]


def text_windows(text: str) -> list[bytes]:
    data = text.encode()
    return [data[i:i + WINDOW_CHARS] for i in range(0, len(data) - WINDOW_CHARS + 1, WINDOW_CHARS)]


def plaintext_seen(
    blobs: Iterable[bytes], prompts: Sequence[Sequence[int]], answers: Sequence[str]
) -> dict[str, int]:
    """How much of the prompts and answers appears in the forwarded bytes."""
    data = b"\x00".join(blobs)
    prompt_windows = [w for p in prompts for w in token_windows(p)]
    answer_windows = [w for a in answers for w in text_windows(a)]
    found_prompt = [w for w in prompt_windows if w in data]
    found_answer = [w for w in answer_windows if w in data]
    return {
        "relay_bytes_searched": len(data),
        "prompt_windows_searched": len(prompt_windows),
        "prompt_windows_found": len(found_prompt),
        "plaintext_prompt_bytes_seen": sum(len(w) for w in found_prompt),
        "answer_windows_searched": len(answer_windows),
        "answer_windows_found": len(found_answer),
    }


def dumped(dump_dir: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(dump_dir.glob("circuit-*.bin"))]


def relay_row(
    dump_dir: Path,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    relay_stats: dict[str, Any],
    differs: int,
) -> dict[str, Any]:
    """The scenario's own fields: what the relay did and saw, and every output that
    differs from the reference whoever served it (a rewritten answer names the target)."""
    return {
        "relay": relay_stats,
        **plaintext_seen(dumped(dump_dir), prompts, answers),
        "outputs_differing_from_reference": differs,
    }
