"""The `prefixswarm` command.

    prefixswarm serve [--bootstrap MULTIADDR ...] [--http 127.0.0.1:8000]   start or join
    prefixswarm generate "Once upon a time"       stream an answer from a running peer
    prefixswarm status                            the peer's view of the swarm, as a table
    prefixswarm local --peers 3 [--demo]          a swarm of N processes on this machine

`serve --report json` prints one JSON object a line on stdout (loading, up, peers, down)
for programs that start peers (`local` does); `--exit-with-stdin` makes a peer stop when
its stdin closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from peer.config import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_IDENTITY_FILE,
    DEFAULT_MODEL,
    DEFAULT_PROBATION_REQUESTS,
    DEFAULT_SUMMARY_INTERVAL_S,
    DEFAULT_VERIFY_FRACTION,
    PeerConfig,
    Policy,
)
from peer.local_swarm import LOCAL_SUMMARY_INTERVAL_S

DEFAULT_HTTP = "127.0.0.1:8000"  # loopback only: without --api-key the API is open
API_KEY_ENV = "PREFIXSWARM_API_KEY"  # the key from the environment keeps it out of `ps`
DEFAULT_URL = "http://127.0.0.1:8000"
PEERS_REPORT_INTERVAL_S = 0.5  # how often `--report json` says which peers are known
CLIENT_TIMEOUT_S = 600.0  # generate/status: a long prompt on a slow CPU takes minutes


def split_host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as '[::1]:PORT') -> (host, port); ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:8000), got {value!r}")
    return host.strip("[]"), int(port)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _say(message: str) -> None:
    print(f"prefixswarm: {message}", file=sys.stderr, flush=True)


# -- serve ---------------------------------------------------------------------------------


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    identity = None if args.identity in ("", "none") else Path(os.path.expanduser(args.identity))
    return PeerConfig(
        model=args.model,
        listen_addrs=tuple(args.listen or ("/ip4/0.0.0.0/tcp/4001",)),
        announce_addrs=tuple(args.announce),
        bootstrap=tuple(args.bootstrap),
        identity_file=identity,
        cache_bytes=args.cache_bytes,
        summary_interval_s=args.summary_interval,
        policy=Policy(args.policy),
        forward_delay_s=getattr(args, "forward_delay", 0.0),
        verify_fraction=getattr(args, "verify_fraction", DEFAULT_VERIFY_FRACTION),
        probation_requests=getattr(args, "probation_requests", DEFAULT_PROBATION_REQUESTS),
        quarantine_file=(
            Path(os.path.expanduser(args.quarantine_file))
            if getattr(args, "quarantine_file", None) else None
        ),
    )


async def _stop_on(waiter: Callable[[], Any], scope: trio.CancelScope) -> None:
    await waiter()
    scope.cancel()


async def _until_stdin_closes() -> None:
    while await trio.to_thread.run_sync(  # type: ignore[call-arg]
        sys.stdin.buffer.readline, abandon_on_cancel=True
    ):
        pass


async def run_serve(args: argparse.Namespace, config: PeerConfig) -> None:
    """Load the model, start the peer (and its HTTP API), run until a signal or EOF."""
    from peer.engine.engine import load_engine  # torch: imported only by commands that need it
    from peer.http import serve_http
    from peer.node import open_peer

    json_report = args.report == "json"
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def first_signal() -> None:
                async for _ in signals:
                    return

            nursery.start_soon(_stop_on, first_signal, nursery.cancel_scope)
            if args.exit_with_stdin:
                nursery.start_soon(_stop_on, _until_stdin_closes, nursery.cancel_scope)
            if json_report:
                _emit({"event": "loading", "model": config.model, "pid": os.getpid()})
            else:
                first_use = " (the first use converts the GGUF: ~20 s)"
                note = first_use if config.model == DEFAULT_MODEL else ""
                _say(f"loading model {config.model}{note}...")
            engine = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                load_engine, config.model, config.cache_bytes, config.block_size,
                abandon_on_cancel=True,  # a signal during loading stops the process at once
            )
            async with open_peer(config, engine=engine) as peer:
                url = None
                if args.http:
                    host, port = split_host_port(args.http)
                    serve = functools.partial(serve_http, api_key=args.api_key or None)
                    url = await peer.start_service(serve, peer, host, port)
                if json_report:
                    _emit(
                        {
                            "event": "up", "pid": os.getpid(), "peer_id": peer.peer_id,
                            "multiaddrs": peer.multiaddrs, "http": url, "model": engine.model_id,
                        }
                    )
                    while True:
                        known = sorted(v.peer_id for v in peer.table.views(trio.current_time()))
                        _emit({"event": "peers", "peer_ids": known})
                        await trio.sleep(PEERS_REPORT_INTERVAL_S)
                else:
                    print(f"peer {peer.peer_id} serves {engine.model_id}; others join with:")
                    for addr in peer.multiaddrs:
                        print(f"  prefixswarm serve --bootstrap {addr}")
                    if url:
                        print(f"HTTP API (OpenAI-compatible): {url}/v1")
                    sys.stdout.flush()
                    await trio.sleep_forever()
    if json_report:
        _emit({"event": "down", "pid": os.getpid()})


# -- generate and status (HTTP clients) --------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    """Stream a completion from a running peer to stdout; the route to stderr."""
    import httpx

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.model:
        body["model"] = args.model
    if args.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    extension: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    with (
        httpx.Client(
            base_url=args.url, timeout=CLIENT_TIMEOUT_S, headers=_auth(args)
        ) as client,
        client.stream("POST", path, json=body) as response,
    ):
        if response.status_code != 200:
            response.read()
            error = response.json().get("error", {})
            print(f"error {response.status_code}: {error.get('message')}", file=sys.stderr)
            return 1
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                print(f"\nerror: {event['error'].get('message')}", file=sys.stderr)
                return 1
            for choice in event.get("choices", []):
                text = choice.get("text") if "text" in choice else choice["delta"].get("content")
                print(text or "", end="", flush=True)
            extension = event.get("x_prefixswarm", extension)
            usage = event.get("usage") or usage
    print()
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    print(
        f"[served by {extension.get('served_by', '?')} (entered at {extension.get('entry_peer')}),"
        f" cached {cached}/{usage.get('prompt_tokens', '?')} prompt tokens,"
        f" first token after {extension.get('ttft_s', 0):.3f} s]",
        file=sys.stderr,
    )
    return 0


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _address(addrs: list[str]) -> str:
    """The first address without its /p2p/<peer id> tail (the PEER column has the id)."""
    return addrs[0].split("/p2p/")[0] if addrs else "-"


def format_status(view: dict[str, Any]) -> str:
    """The /v1/swarm object as a readable table: this peer first, then the others."""
    me = view["self"]
    header = ["PEER", "ADDRESS", "RTT", "LOAD", "CACHED BLOCKS", "SUMMARY AGE", "TRUST"]
    rows = [header]

    def load(p: dict[str, Any]) -> str:
        return f"{p['running_requests']} run, {p['queued_prompt_tokens']} tok queued"

    rows.append(
        [me["peer_id"] + " (this)", _address(me["addrs"]), "-", load(me),
         f"{me['cached_blocks']}/{me['capacity_blocks']}", "-", "-"]
    )
    for p in view["peers"]:
        rtt = "?" if p["rtt_s"] is None else f"{p['rtt_s'] * 1000:.1f} ms"
        rows.append(
            [p["peer_id"], _address(p["addrs"]), rtt, load(p),
             f"~{p['cached_blocks']}/{p['capacity_blocks']}", f"{p['summary_age_s']:.1f} s",
             (p.get("trust") or {}).get("state", "-")]
        )
    title = f"model {me['model']}, policy {me['policy']}, {len(view['peers']) + 1} peers"
    return title + "\n" + _table(rows)


def run_status(args: argparse.Namespace) -> int:
    import httpx

    try:
        response = httpx.get(
            args.url + "/v1/swarm", timeout=CLIENT_TIMEOUT_S, headers=_auth(args)
        )
    except httpx.HTTPError as exc:
        print(f"cannot reach a peer at {args.url}: {exc}", file=sys.stderr)
        return 1
    response.raise_for_status()
    view = response.json()
    print(json.dumps(view, indent=2) if args.json else format_status(view))
    return 0


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


# -- argument parsing --------------------------------------------------------------------


def _api_key_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"{what} (default ${API_KEY_ENV})")


def _peer_options(p: argparse.ArgumentParser, *, summary_interval: float) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, checkpoint folder or hub id")
    p.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES, help="KV cache budget")
    p.add_argument("--policy", default=Policy.COST.value, choices=[x.value for x in Policy])
    p.add_argument("--summary-interval", type=float, default=summary_interval, metavar="S",
                   help="seconds between cache summaries")
    p.add_argument("--log-level", default="WARNING")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixswarm", description="A P2P swarm serving an LLM with prefix-cache routing."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a swarm, or join one with --bootstrap")
    _peer_options(serve, summary_interval=DEFAULT_SUMMARY_INTERVAL_S)
    serve.add_argument("--bootstrap", nargs="+", action="extend", default=[], metavar="MULTIADDR")
    serve.add_argument("--listen", nargs="+", action="extend", metavar="MULTIADDR",
                       help="default /ip4/0.0.0.0/tcp/4001")
    serve.add_argument("--announce", nargs="+", action="extend", default=[], metavar="MULTIADDR",
                       help="addresses to tell others (behind NAT: your public address)")
    serve.add_argument("--identity", default=DEFAULT_IDENTITY_FILE,
                       help="ed25519 key file, created if missing ('none': ephemeral)")
    serve.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                       help="serve the HTTP API here ('' to disable)")
    _api_key_option(serve, "require 'Authorization: Bearer KEY' on every path but /health")
    serve.add_argument("--report", choices=["text", "json"], default="text")
    serve.add_argument("--exit-with-stdin", action="store_true", help="stop when stdin closes")
    serve.add_argument("--forward-delay", type=float, default=0.0, metavar="S",
                       help="benchmarks: add S seconds one-way delay to every forward (WAN)")
    serve.add_argument("--verify-fraction", type=float, default=DEFAULT_VERIFY_FRACTION,
                       metavar="F", help="share of forwarded responses verified before delivery")
    serve.add_argument("--probation-requests", type=int, default=DEFAULT_PROBATION_REQUESTS,
                       metavar="K", help="verified responses before a new peer is trusted")
    serve.add_argument("--quarantine-file", default=None, metavar="PATH",
                       help="quarantined peers (default: quarantine.json next to --identity)")

    gen = sub.add_parser("generate", help="send a prompt to a running peer, stream the answer")
    gen.add_argument("prompt", help="the prompt ('-' reads stdin)")
    gen.add_argument("--url", default=DEFAULT_URL)
    gen.add_argument("--chat", action="store_true", help="as a chat message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--model", default=None)
    _api_key_option(gen, "the peer's API key")

    status = sub.add_parser("status", help="the peer's view of the swarm")
    status.add_argument("--url", default=DEFAULT_URL)
    status.add_argument("--json", action="store_true")
    _api_key_option(status, "the peer's API key")

    local = sub.add_parser("local", help="run N peers on this machine (loopback)")
    _peer_options(local, summary_interval=LOCAL_SUMMARY_INTERVAL_S)
    local.add_argument("--peers", type=int, default=3)
    local.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                       help="the first peer's HTTP API (the others take free ports)")
    local.add_argument("--demo", action="store_true", help="send MMLU questions, print, exit")
    local.add_argument("--json", action="store_true", help="a JSON 'ready' line on stdout")
    local.add_argument("--ready-timeout", type=float, default=600.0, metavar="S")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"), stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub unasked
    try:
        if args.command == "serve":
            trio.run(run_serve, args, config_from_args(args))
            return 0
        if args.command == "generate":
            return run_generate(args)
        if args.command == "status":
            return run_status(args)
        from peer.local_swarm import run_local

        return trio.run(run_local, args)
    except ValueError as exc:  # bad configuration: one clear line, no traceback
        print(f"prefixswarm: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
