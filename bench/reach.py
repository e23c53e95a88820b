"""A peer behind a real NAT: does it know, and does it get work? `python -m bench.reach --json PATH`

On bench/netns.py's topology (root and iptables needed; where the machine cannot, it says
why and exits 2): public peers A (bootstrap, relay) and B (the entry clients call), peers
behind masquerading routers, and four cases in two swarms of tiny-random peers routing by
longest prefix, each case with its own prefix cached on its holder only: no_relay and
relay (`run_relay_swarm`), direct and punch (`run_direct_swarm`). Connection reversal is
tested on loopback (tests/test_holepunch.py). The clients run inside the namespaces
(`--client` re-invokes this module there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bench.netns import Nat, NetnsUnavailable, home_behind_nat
from bench.report import emit_json
from peer.processes import PeerProcess, PeerProcesses, open_peer_processes

PEER_PORT, HTTP_PORT = 4001, 8000
READY_TIMEOUT_S = 60.0  # a tiny-random peer loads in seconds; a loaded CI machine is slow
WAIT_TIMEOUT_S = 30.0  # reachability verdict, summaries: seconds
CLIENT_TIMEOUT_S = 180.0  # one client's waits and requests
MAX_TOKENS = 4
PREFIX_WORDS = 400  # ~500 tokens: 30+ blocks only N caches


def prefix_text(seed: int) -> str:
    rng = random.Random(seed)
    words = ["river", "stone", "lantern", "orbit", "meadow", "cipher", "harbor", "quartz",
             "violet", "ember", "glacier", "tundra", "falcon", "prism", "willow", "saffron"]
    return " ".join(rng.choice(words) for _ in range(PREFIX_WORDS))


# -- clients (run inside a namespace) ---------------------------------------------------


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    response = httpx.request(method, url, json=body, timeout=60.0)
    result: dict[str, Any] = response.json()
    return result


def _poll(what: str, fn: Any) -> Any:
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"bench.reach client: not within {WAIT_TIMEOUT_S} s: {what}")


def client_home(url: str, prompt: str) -> dict[str, Any]:
    """N's side: wait for its reachability verdict, then cache the prefix on N."""
    me = _poll(
        "N's reachability verdict",
        lambda: (s := _http("GET", url + "/v1/swarm")["self"])["reachability"] != "unknown"
        and s,
    )
    _http("POST", url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    return {"reachability": me["reachability"], "addrs": me["addrs"]}


def client_entry(
    url: str, holder: str, prompt: str, requests: int, expect_direct: bool,
    expect_reachable: bool,
) -> dict[str, Any]:
    """B's side: wait until B's table shows N's cached prefix (and, when expected, a
    direct connection to N), then send the requests."""
    def holder_view() -> Any:
        for p in _http("GET", url + "/v1/swarm")["peers"]:
            direct_ok = not expect_direct or p.get("link") == "direct"
            # Only peers with a measured round trip are routed to: wait for one, unless N
            # is meant to be unreachable (the phase without relays).
            routable = not expect_reachable or p.get("rtt_s") is not None
            if p["peer_id"] == holder and p["cached_blocks"] > 0 and direct_ok and routable:
                return p
        return None

    view = _poll("B sees N's cached blocks and measured its round trip", holder_view)
    results = []
    for i in range(requests):
        out = _http("POST", url + "/v1/completions",
                    {"prompt": prompt + f" question {i}", "max_tokens": MAX_TOKENS})
        ext = out.get("x_prefixswarm", {})
        results.append({"served_by": ext.get("served_by"), "ttft_s": ext.get("ttft_s"),
                        "error": out.get("error"),
                        # why it was served there: each peer tried, with its outcome
                        "route": [(step.get("peer_id", "")[-6:], step.get("outcome"),
                                   (step.get("detail") or "")[:80])
                                  for step in ext.get("route") or []]})
    swarm = _http("GET", url + "/v1/swarm")
    after = next((p for p in swarm["peers"] if p["peer_id"] == holder), {})
    return {"holder_addrs": view["addrs"], "link": after.get("link"),
            "link_remote": after.get("link_remote"), "results": results,
            "holepunch": swarm["self"].get("holepunch")}


def client_verdict(url: str) -> dict[str, Any]:
    """An entry behind NAT: wait for its own reachability verdict (caches nothing)."""
    me = _poll(
        "the peer's reachability verdict",
        lambda: (s := _http("GET", url + "/v1/swarm")["self"])["reachability"] != "unknown"
        and s,
    )
    return {"reachability": me["reachability"], "addrs": me["addrs"]}


# -- orchestration (root namespace) --------------------------------------------------------


def _identity_of_a(log_dir: Path, phase: str, a_ip: str) -> tuple[Path, list[str]]:
    """A fresh identity file for public peer A and the --bootstrap flag naming it."""
    # Imported here: the clients (this module run in a namespace) need neither.
    from libp2p.peer.id import ID

    from peer.net.host import load_or_create_identity

    key_file = log_dir / f"{phase}-A.key"
    key_file.unlink(missing_ok=True)
    a_id = ID.from_pubkey(load_or_create_identity(key_file).public_key).to_base58()
    return key_file, ["--bootstrap", f"/ip4/{a_ip}/tcp/{PEER_PORT}/p2p/{a_id}"]


def peer_command(ns: str, ip: str, extra: list[str]) -> list[str]:
    """The argv of one peer in namespace `ns`, listening on `ip`."""
    return Nat.run_in(ns, [
        sys.executable, "-m", "peer.cli", "serve", "--model", "tiny-random",
        "--listen", f"/ip4/{ip}/tcp/{PEER_PORT}",
        "--http", f"{ip}:{HTTP_PORT}", "--report", "json", "--exit-with-stdin",
        "--summary-interval", "0.5", "--policy", "longest_prefix",
        # Reach is measured here, not trust: without probation a new peer takes every
        # request its prefix draws, and without verification the entry never computes
        # (and so caches) the prefix itself, which would pull later requests home
        # (bench.adversary measures both). Nor hedging: on a busy CPU a relayed first
        # token can come after the 0.1 s hedge delay or the 1 s first-token floor, and
        # the entry then serves the request itself (the intended behaviour, which says
        # nothing about whether the NATed peer can be reached).
        "--probation-requests", "0", "--verify-fraction", "0",
        "--hedge-multiple", "0", "--first-token-floor", "5",
        # The API listens on the namespace's address, reached only from this machine.
        "--insecure-no-api-key", *extra,
    ])


async def start_peers(
    procs: PeerProcesses, log_dir: Path, specs: list[tuple[str, str, str, list[str]]]
) -> list[PeerProcess]:
    """Start one peer per (namespace, ip, name, flags) at once (each loads the model);
    return them once every one reported its address."""
    started = [
        await procs.start(peer_command(ns, ip, extra), log_path=log_dir / f"{name}.log")
        for ns, ip, name, extra in specs
    ]
    for proc in started:
        await proc.wait_up(READY_TIMEOUT_S)
    return started


async def _client(ns: str, args: list[str]) -> dict[str, Any]:
    argv = Nat.run_in(ns, [sys.executable, "-m", "bench.reach", "--client", *args])
    with trio.fail_after(CLIENT_TIMEOUT_S):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                      check=False)
    if done.returncode != 0:
        raise RuntimeError(f"client in {ns} failed: {done.stderr.decode().strip()[-2000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _block_b(nat: Nat, router: str, on: bool) -> None:
    """`router` refuses its home peer's connections to B (or stops refusing them)."""
    rule = ["-i", "lan0", "-d", nat.public_ips[1], "-p", "tcp", "-j", "REJECT",
            "--reject-with", "tcp-reset"]
    subprocess.run(Nat.run_in(router, ["iptables", "-I" if on else "-D", "FORWARD", *rule]),
                   check=True, capture_output=True)


def _progress(message: str) -> None:
    print(f"bench.reach: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


async def _cache_on(ns: str, ip: str, prompt: str) -> dict[str, Any]:
    """The home peer's verdict, then `prompt` cached on it (client_home)."""
    return await _client(ns, ["home", f"http://{ip}:{HTTP_PORT}", prompt])


async def _requests_at(ns: str, ip: str, prompt: str, holder: PeerProcess, requests: int, *,
                       expect_direct: bool, expect_reachable: bool) -> dict[str, Any]:
    """The entry peer at `ip` sends `requests` extending `prompt` (client_entry)."""
    return await _client(ns, [
        "entry", f"http://{ip}:{HTTP_PORT}", prompt, "--holder", holder.peer_id,
        "--requests", str(requests), *(["--expect-direct"] if expect_direct else []),
        *(["--expect-reachable"] if expect_reachable else []),
    ])


def _outcome(home: dict[str, Any], entry: dict[str, Any], holder: PeerProcess,
             entry_peer: PeerProcess) -> dict[str, Any]:
    """One case's row: who served the requests extending the holder's prefix."""
    served = [r for r in entry["results"] if r["served_by"] == holder.peer_id]
    return {
        "natted_reachability": home["reachability"],
        "natted_advertised": home["addrs"],
        "entry_link_to_natted": entry["link"],
        "entry_link_remote": entry["link_remote"] or "",
        "requests": len(entry["results"]),
        "served_by_natted": len(served),
        "served_by_entry": sum(r["served_by"] == entry_peer.peer_id for r in entry["results"]),
        "errors": sum(r["error"] is not None for r in entry["results"]),
        "ttft_natted_s": [r["ttft_s"] for r in served],
        "routes": [r["route"] for r in entry["results"]],
        "entry_holepunch": {k: v for k, v in (entry["holepunch"] or {}).items()
                            if k.startswith("holepunch_")},
    }


async def _start_swarm(
    procs: PeerProcesses, nat: Nat, log_dir: Path, name: str, *, b_flags: list[str],
    home2: tuple[str, list[str]],
) -> tuple[PeerProcess, PeerProcess, PeerProcess]:
    """A (bootstrap, relay), B, N behind home and the peer `home2` names behind home2, all
    starting at once (A's identity is made first); returns (B, N, that peer)."""
    _progress(f"{name}: starting peers")
    a_ip, b_ip = nat.public_ips
    key_file, boot = _identity_of_a(log_dir, name, a_ip)
    none = ["--identity", "none"]
    other, other_flags = home2
    _a, b, n, x = await start_peers(procs, log_dir, [
        (nat.public[0], a_ip, f"{name}-A", ["--identity", str(key_file)]),
        (nat.public[1], b_ip, f"{name}-B", [*b_flags, *none, *boot]),
        (nat.home, nat.home_ip, f"{name}-N", [*none, *boot]),
        (nat.home2, nat.home2_ip, f"{name}-{other}", [*other_flags, *none, *boot]),
    ])
    return b, n, x


async def run_relay_swarm(nat: Nat, *, requests: int, log_dir: Path
                          ) -> dict[str, dict[str, Any]]:
    """Cases no_relay and relay in one swarm: A (relay), B (entry), N behind home with
    relays, U behind home2 without (`--no-relays`: no reservation); both routers refuse
    their home peer's connections to B (B stands for any peer a home peer holds no
    connection to). Requests at B for U's prefix (seed 1): B cannot dial U, so it serves
    them itself; for N's (seed 2): N reserved a slot on A, and B reaches N through A."""
    name = "relays"
    b_ip = nat.public_ips[1]
    for router in (nat.router, nat.router2):
        _block_b(nat, router, True)
    try:
        async with open_peer_processes() as procs:  # every peer stops when the swarm ends
            b, n, u = await _start_swarm(procs, nat, log_dir, name, b_flags=[],
                                         home2=("U", ["--no-relays"]))
            no_relay, relay = prefix_text(1), prefix_text(2)
            _progress(f"{name}: peers up; verdicts, caching a prefix on U and one on N")
            home_u = await _cache_on(nat.home2, nat.home2_ip, no_relay)
            home_n = await _cache_on(nat.home, nat.home_ip, relay)
            _progress(f"{name}: U is {home_u['reachability']}, N is {home_n['reachability']};"
                      " requests at B")
            at_u = await _requests_at(nat.public[1], b_ip, no_relay, u, requests,
                                      expect_direct=False, expect_reachable=False)
            at_n = await _requests_at(nat.public[1], b_ip, relay, n, requests,
                                      expect_direct=False, expect_reachable=True)
    finally:
        for router in (nat.router, nat.router2):
            _block_b(nat, router, False)
    return {"no_relay": _outcome(home_u, at_u, u, b), "relay": _outcome(home_n, at_n, n, b)}


async def run_direct_swarm(nat: Nat, *, requests: int, log_dir: Path
                           ) -> dict[str, dict[str, Any]]:
    """Cases direct and punch in one swarm: A (relay, the only one), B (public entry), N
    behind home (holds both prefixes), M behind home2 (the other entry).

    direct: N may dial B, and serves B's requests (seed 3) over its own outbound
    connection. punch: neither N nor M can dial the other (both routers drop unsolicited
    connections), so the only direct connection between them is one the hole punch
    (simultaneous open) made; M's requests (seed 4) go over it."""
    name = "direct"
    a_ip, b_ip = nat.public_ips
    async with open_peer_processes() as procs:  # every peer stops when the swarm ends
        b, n, m = await _start_swarm(procs, nat, log_dir, name,
                                     b_flags=["--no-relay-service"], home2=("M", []))
        direct, punch = prefix_text(3), prefix_text(4)
        _progress(f"{name}: peers up; verdicts, caching two prefixes on N")
        home = await _cache_on(nat.home, nat.home_ip, direct)
        home_again = await _cache_on(nat.home, nat.home_ip, punch)
        entry_self = await _client(nat.home2, ["verdict", f"http://{nat.home2_ip}:{HTTP_PORT}",
                                               punch])
        _progress(f"{name}: N is {home['reachability']}, M is {entry_self['reachability']};"
                  " requests at B, then at M once its link to N is direct")
        at_b = await _requests_at(nat.public[1], b_ip, direct, n, requests,
                                  expect_direct=True, expect_reachable=True)
        at_m = await _requests_at(nat.home2, nat.home2_ip, punch, n, requests,
                                  expect_direct=True, expect_reachable=True)
    punched = _outcome(home_again, at_m, n, m)
    stats = at_m["holepunch"] or {}
    punched.update({
        "entry_reachability": entry_self["reachability"],
        "link_remote_is_relay": punched["entry_link_remote"].split(":")[0] == a_ip,
        "upgraded": stats.get("upgraded", {}).get(n.peer_id),
    })
    return {"direct": _outcome(home, at_b, n, b), "punch": punched}


async def run_phases(nat: Nat, requests: int, log_dir: Path) -> dict[str, Any] | None:
    """The four cases, in two swarms one after the other; None when a SIGTERM (a CI
    timeout) stopped them, after every peer was stopped."""
    phases: dict[str, Any] | None = None
    async with trio.open_nursery() as nursery:

        async def stop_on_sigterm() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(stop_on_sigterm)
        phases = {
            **await run_relay_swarm(nat, requests=requests, log_dir=log_dir),
            **await run_direct_swarm(nat, requests=requests, log_dir=log_dir),
        }
        nursery.cancel_scope.cancel()
    return phases


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reach", description=__doc__)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--requests", type=int, default=8, help="requests per phase")
    parser.add_argument("--client", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--holder", help=argparse.SUPPRESS)
    parser.add_argument("--expect-direct", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--expect-reachable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        kind, url, prompt = args.client
        out = (client_home(url, prompt) if kind == "home"
               else client_verdict(url) if kind == "verdict"
               else client_entry(url, args.holder, prompt, args.requests, args.expect_direct,
                                args.expect_reachable))
        print(json.dumps(out))
        return 0
    tag = f"{os.getpid() % 100000}"
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-reach-{tag}"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # A SIGTERM (a CI timeout) must still delete the namespaces: make it an exception
    # (while the phases run, they catch it themselves and stop their peers first).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"bench.reach: signal {signum}"))
    try:
        with home_behind_nat(tag) as nat:
            phases = trio.run(run_phases, nat, args.requests, log_dir)
    except NetnsUnavailable as exc:
        print(f"bench.reach: cannot build network namespaces here: {exc}", file=sys.stderr)
        return 2
    if phases is None:
        sys.exit(f"bench.reach: signal {signal.SIGTERM}")
    relay, punch = phases["relay"], phases["punch"]
    # Upgrades the entry took part in, as initiator or responder (either side may start
    # one: the first relayed stream, a request or a liveness ping, decides).
    counts = {
        f"{mechanism}_{outcome}": sum(
            p.get("entry_holepunch", {}).get(f"holepunch_{side}{mechanism}_{outcome}", 0)
            for p in phases.values() for side in ("", "served_")
        )
        for mechanism in ("reversal", "simultaneous_open") for outcome in ("ok", "failed")
    }
    # True only when the upgrade made a connection (the entry's record of the upgrade says
    # so), its far end is not the relay, and N served requests over it (the entry sent
    # them only once its link to N was direct; how many N got is routing's choice: under
    # load a stalled first token sends later requests elsewhere, as in the direct phase).
    punched = (
        punch["upgraded"] is not None
        and punch["entry_link_to_natted"] == "direct"
        and not punch["link_remote_is_relay"]
        and bool(punch["entry_link_remote"])
        and punch["served_by_natted"] > 0
    )
    result = {
        "natted_peer_knows_unreachable": all(
            p["natted_reachability"] == "private" for p in phases.values()
        ),
        "no_relay_requests_served_by_natted": phases["no_relay"]["served_by_natted"],
        "relayed_requests_ok": relay["served_by_natted"],
        "relayed_requests_failed": relay["requests"] - relay["served_by_natted"],
        "direct_requests_served_by_natted": phases["direct"]["served_by_natted"],
        "direct_after_holepunch": punched,
        "holepunch_mechanism": punch["upgraded"]["mechanism"] if punch["upgraded"] else None,
        "holepunch_counts": counts,
        "holepunch_requests_ok": punch["served_by_natted"] if punched else 0,
        "holepunch_requests": punch["requests"],
        "ttft_direct_s": _median(punch["ttft_natted_s"]) if punched else None,
        "ttft_outbound_direct_s": _median(phases["direct"]["ttft_natted_s"]),
        "ttft_relayed_s": _median(relay["ttft_natted_s"]),
        "phases": phases,
        "wall_s": round(time.monotonic() - started, 1),
        "logs": str(log_dir),
    }
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
