"""The relay_impersonator bench's instruments (bench/adversary_relay.py,
bench/rogues/relay_impersonator.py) find plaintext when there is some, and rewrite
plaintext answers: so their zeros through an encrypted relay mean something."""

from __future__ import annotations

import random

from bench.adversary_relay import honest_shape, plaintext_seen
from bench.rogues.relay_impersonator import PlaintextProbe, rewrite_tokens
from protocols.framing import MAX_FRAME_BYTES, encode_frame
from protocols.infer import InferRequest, TokenChunk

PROMPT = tuple(random.Random(1).randrange(100, 49152) for _ in range(200))
ANSWER = "The answer is (B) because the mitochondria"


def request_frame() -> bytes:
    request = InferRequest(request_id="r1", prompt_token_ids=PROMPT, max_new_tokens=8,
                           deadline_s=10.0)
    return encode_frame(request.to_wire(), MAX_FRAME_BYTES)


def test_a_plaintext_relay_sees_the_prompt_and_the_answer():
    chunk = encode_frame(TokenChunk((5, 6), ANSWER).to_wire())
    seen = plaintext_seen([b"xx" + request_frame()[:-3], chunk], [PROMPT], [ANSWER])
    assert seen["prompt_windows_found"] >= seen["prompt_windows_searched"] - 1 > 20
    assert seen["plaintext_prompt_bytes_seen"] > 100
    assert seen["answer_windows_found"] == 2


def test_random_bytes_show_nothing():
    noise = random.Random(2).randbytes(1 << 20)
    seen = plaintext_seen([noise], [PROMPT], [ANSWER])
    assert seen["prompt_windows_found"] == 0 and seen["answer_windows_found"] == 0
    assert seen["plaintext_prompt_bytes_seen"] == 0


def test_the_probe_reads_plaintext_requests_and_gives_up_on_ciphertext():
    probe = PlaintextProbe()
    frame = request_frame()
    probe.feed(frame[:100])
    probe.feed(frame[100:])
    assert (probe.prompts_seen, probe.prompt_tokens_seen) == (1, len(PROMPT))
    blind = PlaintextProbe()
    blind.feed(b"\xff" * 64)
    blind.feed(frame)
    assert blind.prompts_seen == 0


def test_plaintext_answers_are_rewritten_and_ciphertext_is_not_parsed():
    chunk = encode_frame(TokenChunk((5, 6), "ab").to_wire())
    rewritten = rewrite_tokens(chunk)
    assert rewritten is not None and rewritten != chunk
    assert rewrite_tokens(random.Random(3).randbytes(300)) is None


def test_the_shape_forces_relaying():
    assert honest_shape(0) == ("/ip4/127.0.0.1/tcp/0", ("--no-relay-service",))
    assert honest_shape(1)[0] == honest_shape(2)[0] == "none"
