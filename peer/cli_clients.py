"""`prefixswarm generate` and `prefixswarm status`: HTTP clients of a running peer."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["EXIT_FAILURE", "format_status", "run_generate", "run_status", "say"]

CLIENT_TIMEOUT_S = 600.0  # generate/status: a long prompt on a slow CPU takes minutes
EXIT_FAILURE = 1  # the peer or a client failed at run time (unreachable, load failed)


def say(message: str) -> None:
    """A line for the user on stderr, as every prefixswarm command writes them."""
    print(f"prefixswarm: {message}", file=sys.stderr, flush=True)


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
    try:
        return _stream_generation(args.url, path, body, _auth(args))
    except httpx.HTTPError as exc:
        say(f"cannot reach a peer at {args.url}: {exc or type(exc).__name__}")
        return EXIT_FAILURE


def _error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(response.text[:200] or response.reason_phrase)


def _stream_generation(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> int:
    import httpx

    extension: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    with (
        httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S, headers=headers) as client,
        client.stream("POST", path, json=body) as response,
    ):
        if response.status_code != 200:
            response.read()
            print(f"error {response.status_code}: {_error_message(response)}", file=sys.stderr)
            return EXIT_FAILURE
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


def _software(p: dict[str, Any]) -> str:
    """A peer's software, marked when older than the asked peer's (it may lack fixes)."""
    name = p.get("software") or "?"
    return f"{name} (older)" if p.get("older_software") else name


def format_status(view: dict[str, Any]) -> str:
    """The /v1/swarm object as a readable table: this peer first, then the others."""
    me = view["self"]
    header = ["PEER", "ADDRESS", "RTT", "LOAD", "CACHED BLOCKS", "SUMMARY AGE", "TRUST",
              "SOFTWARE"]
    rows = [header]

    def load(p: dict[str, Any]) -> str:
        return f"{p['running_requests']} run, {p['queued_prompt_tokens']} tok queued"

    rows.append(
        [me["peer_id"] + " (this)", _address(me["addrs"]), "-", load(me),
         f"{me['cached_blocks']}/{me['capacity_blocks']}", "-", "-", me.get("software") or "?"]
    )
    for p in view["peers"]:
        rtt = "?" if p["rtt_s"] is None else f"{p['rtt_s'] * 1000:.1f} ms"
        rows.append(
            [p["peer_id"], _address(p["addrs"]), rtt, load(p),
             f"~{p['cached_blocks']}/{p['capacity_blocks']}", f"{p['summary_age_s']:.1f} s",
             (p.get("trust") or {}).get("state", "-"), _software(p)]
        )
    title = f"model {me['model']}, policy {me['policy']}, {len(view['peers']) + 1} peers"
    if "reachability" in me:
        title += f", this peer is {me['reachability']}"
    older = sum(1 for p in view["peers"] if p.get("older_software"))
    if older:
        title += f"; {older} peers run older software"
    invite = view.get("invite")
    join = f"others join with: prefixswarm serve --join {invite}" if invite else (
        "no dialable address to invite others with yet (behind NAT: see docs/joining.md)"
    )
    return title + "\n" + _table(rows) + "\n" + join


def run_status(args: argparse.Namespace) -> int:
    import httpx

    try:
        response = httpx.get(
            args.url + "/v1/swarm", timeout=CLIENT_TIMEOUT_S, headers=_auth(args)
        )
    except httpx.HTTPError as exc:
        say(f"cannot reach a peer at {args.url}: {exc or type(exc).__name__}")
        return EXIT_FAILURE
    if response.status_code != 200:
        say(f"{args.url}/v1/swarm: error {response.status_code}: {_error_message(response)}")
        return EXIT_FAILURE
    view = response.json()
    print(json.dumps(view, indent=2) if args.json else format_status(view))
    return 0


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
