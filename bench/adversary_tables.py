"""What bench.adversary measures of the table scenarios, around its requests.

- private_evictor (the rogue is a client, no rogue process): PRIVATE_REQUESTS salted
  requests of PRIVATE_PROMPT_TOKENS tokens to the first honest peer (the server) while
  the requests run; every SAMPLE_INTERVAL_S, whether each other honest peer's table
  lists the server, until SETTLE_S after the last one. Row keys: private_requests_ok /
  _failed, server_in_tables_share (the worst other peer's share of samples listing it),
  server_dropped_by.
- table_filler: the requests run under the rogue's floods; then a late honest peer joins
  (still under them); the seconds until every first honest peer's table lists it
  (late_peer_in_tables_s, null if not within LATE_JOIN_TIMEOUT_S), its share of samples
  in every table over LATE_PRESENCE_WINDOW_S, and the dials to fake providers the
  rogue's sink counted since it was started.

Both also sample a control while the requests run: whether the second honest peer stays
in the others' tables (control_in_tables_share): what a loaded machine's late summaries
cost any peer.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from bench.swarm import stream_completion
from peer.processes import PeerProcess

CLIENT_ROGUES = frozenset({"private_evictor"})  # scenarios with no rogue process
PRIVATE_REQUESTS = 8
PRIVATE_PROMPT_TOKENS = 600
PRIVATE_CONCURRENCY = 2
SAMPLE_INTERVAL_S = 0.25  # peers report their tables every 0.5 s (peer/cli.py)
SETTLE_S = 5.0  # watched this long after the last private request: the drop came by then
LATE_JOIN_TIMEOUT_S = 90.0
LATE_PRESENCE_WINDOW_S = 15.0  # the late peer's presence in every table, sampled this long
REQUEST_TIMEOUT_S = 150.0


class _Presence:
    """Samples of whether `target` is listed by each of `watchers`."""

    def __init__(self, target: str, watchers: Sequence[PeerProcess]) -> None:
        self.target = target
        self.watchers = list(watchers)
        self.samples = 0
        self.listed = [0] * len(self.watchers)
        self.first_missing: list[float | None] = [None] * len(self.watchers)

    async def run(self, started: float) -> None:
        while True:
            self.samples += 1
            for i, peer in enumerate(self.watchers):
                if self.target in peer.known:
                    self.listed[i] += 1
                elif self.first_missing[i] is None:
                    self.first_missing[i] = trio.current_time() - started
            await trio.sleep(SAMPLE_INTERVAL_S)

    def worst_share(self) -> float | None:
        return min(self.listed) / self.samples if self.samples else None


@asynccontextmanager
async def open_measurement(
    name: str,
    args: Any,
    honest: list[PeerProcess],
    spawn_late: Callable[[], Awaitable[PeerProcess]],
    rogue_answered: Callable[[], dict[str, int]],
) -> AsyncIterator[dict[str, Any]]:
    """Around the scenario's requests: the attack (a client's) and the measurement."""
    row: dict[str, Any] = {}
    if name == "private_evictor":
        async with _private_evictor(args, honest, row):
            yield row
    elif name == "table_filler":
        async with _late_joiner(honest, spawn_late, rogue_answered, row):
            yield row
    else:
        yield row


@asynccontextmanager
async def _private_evictor(
    args: Any, honest: list[PeerProcess], row: dict[str, Any]
) -> AsyncIterator[None]:
    server, others = honest[0], honest[1:]
    presence = _Presence(server.peer_id, others)
    control = _Presence(honest[1].peer_id, [honest[0], honest[2]])
    results: list[str] = []
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(presence.run, started)
        nursery.start_soon(control.run, started)
        attack_done = trio.Event()

        async def attack() -> None:
            await _private_requests(args, server, results)
            attack_done.set()

        nursery.start_soon(attack)
        yield
        await attack_done.wait()
        await trio.sleep(SETTLE_S)
        nursery.cancel_scope.cancel()
    row["private_requests_ok"] = results.count("")
    row["private_requests_failed"] = len(results) - results.count("")
    row["private_errors"] = sorted({e[:200] for e in results if e})
    row["server_in_tables_share"] = presence.worst_share()
    row["control_in_tables_share"] = control.worst_share()
    row["server_in_tables_samples"] = presence.samples
    row["server_dropped_by"] = sum(t is not None for t in presence.first_missing)
    row["server_first_missing_s"] = [
        None if t is None else round(t, 2) for t in presence.first_missing
    ]


async def _private_requests(args: Any, server: PeerProcess, results: list[str]) -> None:
    rng = random.Random(args.seed + 7)
    limiter = trio.CapacityLimiter(PRIVATE_CONCURRENCY)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client, \
            trio.open_nursery() as nursery:
        for i in range(PRIVATE_REQUESTS):
            body = {
                "model": args.model_name,
                "prompt": [rng.randrange(100, 5000) for _ in range(PRIVATE_PROMPT_TOKENS)],
                "max_tokens": args.max_new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "cache_salt": f"private-evictor-{i}",
            }

            async def one(body: dict[str, Any] = body) -> None:
                async with limiter:
                    got = await stream_completion(client, server.http, body, REQUEST_TIMEOUT_S)
                results.append(got.error or ("" if got.first is not None else "no tokens"))

            nursery.start_soon(one)


@asynccontextmanager
async def _late_joiner(
    honest: list[PeerProcess],
    spawn_late: Callable[[], Awaitable[PeerProcess]],
    rogue_answered: Callable[[], dict[str, int]],
    row: dict[str, Any],
) -> AsyncIterator[None]:
    """The requests run first, then the late peer joins, still under the floods: a peer
    starting on the same cores during the requests would cost them by itself (its
    start-up work), which the baseline's requests never pay."""
    control = _Presence(honest[1].peer_id, [honest[0], honest[2]])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(control.run, trio.current_time())
        yield
        nursery.cancel_scope.cancel()
    row["control_in_tables_share"] = control.worst_share()
    dials_before = rogue_answered().get("fake_provider_dials", 0)
    started = trio.current_time()
    late = await spawn_late()
    joined = trio.current_time()
    row["late_peer_up_s"] = round(joined - started, 2)
    row["late_peer_in_tables_s"] = None
    with trio.move_on_after(LATE_JOIN_TIMEOUT_S):
        while not all(late.peer_id in p.known for p in honest):
            await trio.sleep(SAMPLE_INTERVAL_S)
        row["late_peer_in_tables_s"] = round(trio.current_time() - joined, 2)
    row["late_peer_listed_by"] = sum(late.peer_id in p.known for p in honest)
    presence = _Presence(late.peer_id, honest)
    with trio.move_on_after(LATE_PRESENCE_WINDOW_S):
        await presence.run(trio.current_time())
    row["late_peer_in_tables_share"] = presence.worst_share()
    answered = rogue_answered()
    row["fake_providers"] = answered.get("fake_providers", 0)
    row["fake_provider_dials"] = answered.get("fake_provider_dials", 0)
    row["fake_provider_dials_since_late_join"] = row["fake_provider_dials"] - dials_before
    row["fake_provider_dials_window_s"] = round(trio.current_time() - started, 1)
