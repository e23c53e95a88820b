"""The request path when the serving peer is another OS process that stops answering."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from peer.config import Policy
from peer.engine.engine import SamplingParams
from peer.request.pipeline import Outcome
from tests.helpers_swarm import spawn_peer_process, start_peer, wait_until
from tests.test_pipeline import claim_prefix, config, reference, tokens

FIRST_TOKEN_DEADLINE_S = 2.0


@pytest.mark.slow  # one interpreter start-up with torch: ~10 s on a loaded machine
async def test_a_stalled_peer_is_abandoned_at_the_deadline(
    nursery, runners, tiny_engine_factory, tmp_path
):
    with trio.fail_after(90):
        stalled = await spawn_peer_process(
            runners,
            ["--model", "tiny-random", "--interval", "5", "--report-interval", "0.5"],
            stderr_path=tmp_path / "stderr.log",
        )
        entry = await start_peer(
            nursery,
            config(
                stalled.multiaddrs,
                policy=Policy.LONGEST_PREFIX,
                summary_interval_s=5.0,  # the stopped peer stays in the table for 15 s
                forward_first_token_s=FIRST_TOKEN_DEADLINE_S,
                first_token_floor_s=FIRST_TOKEN_DEADLINE_S,  # the estimate's multiple is less
            ),
            tiny_engine_factory(),
        )
        await wait_until(
            lambda: getattr(entry.peer.table.get(stalled.peer_id, trio.current_time()),
                            "rtt_s", None) is not None,
            timeout_s=30,
            what="the entry peer knows the other process and measured a round trip",
        )
        prompt = tokens(200, seed=21)

        class Holder:  # claim_prefix wants a RunningPeer-like object for the liar
            class peer:
                peer_id = stalled.peer_id

        claim_prefix(entry, Holder, prompt)  # type: ignore[arg-type]
        os.kill(stalled.process.pid, signal.SIGSTOP)
        try:
            params = SamplingParams(max_new_tokens=6)
            start = trio.current_time()
            result = await entry.peer.generate(prompt, params)
            elapsed = trio.current_time() - start
        finally:
            os.kill(stalled.process.pid, signal.SIGCONT)

    assert [(a.peer_id, a.outcome) for a in result.route] == [
        (stalled.peer_id, Outcome.STALLED),
        (entry.peer.peer_id, Outcome.OK),
    ]
    assert FIRST_TOKEN_DEADLINE_S <= elapsed < FIRST_TOKEN_DEADLINE_S + 5
    assert result.token_ids == await reference(tiny_engine_factory, prompt, params)
