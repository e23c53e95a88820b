"""The official `openai` Python package talking to a prefixswarm peer.

    python examples/openai_client.py --url http://127.0.0.1:8000   # a running peer
    python examples/openai_client.py --model tiny-random            # starts its own peer

Without --url it starts `prefixswarm serve` as a child process (loopback, ephemeral
identity, a free HTTP port) and stops it at the end. Shows a completion, a streamed chat,
cached prompt tokens, and which peer served each request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import openai

SYSTEM = "You are a helpful assistant who answers briefly. " * 6  # a prefix worth caching


@contextlib.contextmanager
def local_peer(model: str) -> Iterator[str]:
    """A `prefixswarm serve` child; yields its HTTP URL. It stops when we close its stdin."""
    cmd = [sys.executable, "-m", "peer.cli", "serve", "--model", model, "--identity", "none",
           "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0", "--report", "json",
           "--exit-with-stdin"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        for line in child.stdout:
            report = json.loads(line)
            if report["event"] == "up":
                yield report["http"]
                break
        else:
            raise RuntimeError("the peer exited before it was up")
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(url: str, model: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)
    print("models:", [m.id for m in client.models.list().data])

    for question in ("What is 2 + 2?", "What is the largest ocean?"):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=16,
            temperature=0,
        )
        extra = reply.model_extra["x_prefixswarm"]
        usage = reply.usage
        print(f"{question} -> {reply.choices[0].message.content!r}")
        print(f"  cached {usage.prompt_tokens_details.cached_tokens}/{usage.prompt_tokens} prompt "
              f"tokens, served by {extra['served_by'][:16]}..., route "
              f"{[a['outcome'] for a in extra['route']]}")

    print("streamed completion: ", end="", flush=True)
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        elif chunk.usage:
            print(f"\n  ({chunk.usage.completion_tokens} tokens)")

    try:
        client.completions.create(model="gpt-4", prompt="hi")
    except openai.NotFoundError as exc:
        print(f"an unknown model is refused: {exc.status_code} {exc.code}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running peer's HTTP API")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    if args.url:
        main(args.url, args.model)
    else:
        with local_peer(args.model) as peer_url:
            main(peer_url, args.model)
