"""SIGTERM drains a peer: it stops accepting, the generation in flight finishes and its
client gets the whole answer, then the process exits 0 (a real process, real HTTP)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 600  # a few seconds of tiny-random on a busy machine
DRAIN_TIMEOUT_S = 30.0  # the default


def _serve() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "peer.cli", "serve", "--config", "none", "--identity", "none",
         "--model", "tiny-random", "--listen", "/ip4/127.0.0.1/tcp/0",
         "--http", "127.0.0.1:0", "--report", "json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.mark.slow
def test_sigterm_lets_the_generation_in_flight_finish_then_exits() -> None:
    process = _serve()
    try:
        assert process.stdout is not None
        up: dict[str, Any] = next(
            e for line in process.stdout if (e := json.loads(line))["event"] == "up"
        )
        body = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        chunks: list[dict[str, Any]] = []
        signalled_at = None
        with httpx.stream("POST", up["http"] + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line.removeprefix("data: ")))
                if signalled_at is None and chunks[-1]["choices"]:
                    process.send_signal(signal.SIGTERM)  # mid-generation
                    signalled_at = time.monotonic()
                    time.sleep(0.5)  # the drain has begun: new connections are refused
                    with pytest.raises(httpx.ConnectError):
                        httpx.get(up["http"] + "/health", timeout=5)
        assert signalled_at is not None
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS  # the whole answer
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"
        _, err = process.communicate(timeout=DRAIN_TIMEOUT_S + 30)
        assert process.returncode == 0, err[-2000:]
        assert time.monotonic() - signalled_at < DRAIN_TIMEOUT_S + 15
        assert "leaving: finishing the requests in flight" in err
        assert "cut off" not in err
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
