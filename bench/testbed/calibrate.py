"""Each testbed peer's speed under its CPU quota, as the simulator's Calibration.

A peer is measured over HTTP with greedy requests of one new token, for prompts of random
token ids (never in any cache) of a few lengths cold, then the same prompts extended so
that all but the extension is cached; the median of `REPEATS` draws per point. A
request's time is the CPU seconds its peer's CPU group used for it over the peer's share
(the time it takes at the full quota; robust to other work on the machine, which
stretches wall-clock times), or, without CPU groups, the client's time to first token.
A least-squares fit of the simulator's prefill form (bench/sim/calibration.py
`Calibration.from_points`) gives fixed, per-token and attention costs; the fixed term
holds everything a request pays besides its prompt (HTTP, routing at the entry, the
stream, the sampler), which the simulator has no other place for. Decode per token is
the difference between a request with DECODE_TOKENS new tokens and one with one, over
DECODE_TOKENS - 1 (CPU), or (end - first token) / (DECODE_TOKENS - 1) (wall clock).

A lone request's wall clock holds more than its peer's CPU: the client's HTTP stack, the
hops through the link emulator, thread hand-offs. With CPU groups, a short cold
request's TTFT less the CPU its peer spent before the first token (at a core's speed, as
a quota lets a lone request run from a fresh period's budget, walked through the periods
by bench/sim/quota.py as the simulator will; each such request after a rest of
QUOTA_REST_S or QUOTA_REST_PERIODS periods, so that it finds a full budget) is the
calibration's `client_path_s`, which the
simulator adds to every request that enters at that peer (0 without CPU groups: the
wall clock is the measure there).

A peer also spends CPU with no request at all (gossip, pings, the DHT): its rate over the
gossip measurement's idle windows (`measure_gossip`, run first: GOSSIP_CYCLES + 1
windows of `Effort.gossip_window_s` for all peers at once, spread over the swarm's first
minute) is taken off its share, and requests get the share less it (their CPU less that
rate over their wall time, over share - rate), since the simulator gives a peer's whole
share to requests. An idle peer's CPU comes in bursts (on the AVX2 EPYC, 3-s windows of
an idle four-peer swarm: 0.035-0.05 of a core, 0.06-0.08 in the first seconds after
start-up, 0.08-0.19 in one window about every 30 s), so the 3 s of its own that each
peer had before, each at another moment of the swarm's life, put the first peer
measured, right after start-up, at about twice the others in every committed run.

What a request costs besides the engine's forward steps (HTTP, routing, the stream) is
the fit's fixed term less a lone step's fixed cost in the simulator, split at the first
token by the wall-clock share of a short cold request's time that comes before it (its
TTFT over its end to end, `first_token_fraction`: the simulator's `request_overhead_s`
before, `request_tail_s` after). A forward costs its entry too: `measure_forward` sends requests one
at a time to one entry of a `random` swarm and takes the entry's CPU per request that
another peer served (the simulator's `forward_overhead_s`, the same CPU seconds over each
peer's share), and each serving peer's CPU for those, less what its own calibration gives
the same request from a client of its own (`served_overhead_s`: the stream and the
signed answer in place of HTTP).

Every cache summary costs CPU too, at its publisher and at every receiver (decrypting,
checking, applying and relaying it: py-libp2p's work mostly), and in a testbed run each
request that changes a small cache by CHANGE_FRACTION sends one. `measure_gossip` drives
one peer with requests that each change its cache, far enough apart that each sends a
summary, and takes every peer's CPU over an idle window of the same length off (the idle
summaries, one per interval, are in that rate): per extra summary, the publisher's CPU
beyond its requests' own and each receiver's (the simulator's `summary_publish_s` and
`summary_receive_s`, over each peer's share).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import trio

from bench.sim.calibration import Calibration
from bench.sim.quota import DEFAULT_PERIOD_S, CpuQuota
from bench.swarm import stream_completion

COLD_LENGTHS = (32, 512, 1024)  # prompt tokens of the cold points
EXTENSION_TOKENS = 96  # new tokens after a cached prompt (the warm points)
DECODE_TOKENS = 12
REPEATS = 5  # draws per point: at 3 the fit moved by more than the predictions' tolerance
TOKEN_RANGE = (1000, 40000)  # ids well inside the SmolLM2 vocabulary, no special tokens
TIMEOUT_S = 60.0
MIN_S_PER_TOKEN = 1e-6  # a floor where noise hides the per-token cost
MAX_BACKGROUND = 0.5  # of the share: more says the measurement broke, not the peer
FORWARD_REQUESTS = 40  # one after another at one entry of a `random` swarm
FORWARD_PROMPT_TOKENS = 32
FORWARD_IDLE_S = 3.0  # the fresh `random` swarm watched idle first: its background rate
SETTLE_S = 0.3  # after each: the entry's work after the stream (verdicts, shadows) ends
QUOTA_REST_S = 0.25  # before a lone request, at least: a full budget (2.5 periods of the
#   kernel's 100 ms; right after the decode pair the 0.2-core peer's quota was spent: +42 ms)
QUOTA_REST_PERIODS = 2.5  # ... and at least this many of a longer period
GOSSIP_WINDOW_S = 10.0  # idle, then churning: the periodic work (pings, dial-backs) evens out
GOSSIP_CYCLES = 2  # churning windows, each between idle ones
GOSSIP_REQUEST_GAP_S = 0.3  # > the early-publish gap (a quarter interval): a summary each
GOSSIP_PROMPT_TOKENS = 512  # 32 blocks of 16: > CHANGE_FRACTION of the testbed's caches


@dataclass(frozen=True)
class Effort:
    """How much a calibration measures: draws per point, forwarded requests, the gossip
    windows' length (the idle rates too). The full run's are the constants above;
    `--quick`, a smoke test of the whole path, measures less (QUICK_EFFORT: on a slow
    2-core machine its calibration took 4 of its 8 minutes). Peers are measured one after
    another: measured all at once (their CPU groups keep them apart), the 0.2-core peer's
    prefill came out 7x slower a token in one try, and every prediction slower than
    measured."""

    repeats: int = REPEATS
    forward_requests: int = FORWARD_REQUESTS
    gossip_window_s: float = GOSSIP_WINDOW_S


QUICK_EFFORT = Effort(repeats=2, forward_requests=12, gossip_window_s=4.0)


@dataclass(frozen=True)
class PeerSpeed:
    """One peer's measured points and the calibration fitted to them."""

    points: tuple[tuple[int, int, float], ...]  # (cached tokens, new tokens, TTFT s)
    decode_s_per_token: float
    calibration: Calibration
    background_cores: float = 0.0  # CPU the idle peer used (cores), taken off its share
    first_token_fraction: float = 1.0  # a short cold request's TTFT over its end to end

    def as_dict(self) -> dict[str, Any]:
        return {
            "points": [list(p) for p in self.points],
            "decode_s_per_token": self.decode_s_per_token,
            "background_cores": self.background_cores,
            "first_token_fraction": self.first_token_fraction,
            "calibration": self.calibration.as_dict(),
        }


async def _ttft(client: httpx.AsyncClient, url: str, model: str, prompt: Sequence[int],
                max_tokens: int = 1) -> tuple[float, float]:
    """(TTFT, end to end) of one greedy streamed request; RuntimeError on failure."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    got = await stream_completion(client, url, body, TIMEOUT_S)
    if got.error or got.first is None:
        raise RuntimeError(f"calibration request to {url} failed: {got.error}")
    return got.first - got.start, got.end - got.start


Clock = Callable[[], float]  # seconds of some kind, read before and after a request


async def first_requests(urls: Sequence[str], model: str) -> None:
    """One short request to each peer at once: its lazy set-up, before anything measured."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client, trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(_ttft, client, url, model, [TOKEN_RANGE[0]] * 16)


def background_cores(idle_rates: Sequence[float], shares: Sequence[float]) -> list[float]:
    """Each peer's idle CPU rate (cores), at most MAX_BACKGROUND of its share: more says
    the measurement broke, not the peer."""
    return [min(max(rate, 0.0), MAX_BACKGROUND * share)
            for rate, share in zip(idle_rates, shares, strict=True)]


async def measure_peer(url: str, model: str, name: str, seed: int, cpu: Clock | None = None,
                       share: float = 1.0, block_size: int = 16,
                       repeats: int = REPEATS, background: float = 0.0,
                       period_s: float = DEFAULT_PERIOD_S) -> PeerSpeed:
    """Measure the peer at `url` (nothing else should be sent to it meanwhile).

    With `cpu` (the peer's CPU seconds so far, from its CPU group, whose CFS period is
    `period_s`) a request's time is the CPU it used over `share` less `background` (the
    idle peer's cores, `background_cores`): what it takes at the peer's full quota,
    whatever else runs on the machine. Without, the client's wall-clock TTFT."""
    rng = random.Random(f"{seed}/calibrate/{url}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    fractions: list[float] = []  # wall TTFT over end to end, short cold prompts
    paths: list[float] = []  # their wall TTFT less the CPU before it, at a core's speed

    async def timed(client: httpx.AsyncClient, prompt: list[int],
                    max_tokens: int = 1, lone: bool = False) -> float:
        """The request's time (above); `lone`: after a rest that gives it a full quota
        period, as a request finds an idle peer, its client path is read too."""
        if lone and cpu:
            await trio.sleep(max(QUOTA_REST_S, QUOTA_REST_PERIODS * period_s))
        before = cpu() if cpu else 0.0
        start = trio.current_time()
        ttft, e2e = await _ttft(client, url, model, prompt, max_tokens)
        if len(prompt) == COLD_LENGTHS[0] and max_tokens == 1 and e2e > 0:
            fractions.append(ttft / e2e)
        if not cpu:
            return ttft
        used = max(cpu() - before - background * (trio.current_time() - start), 0.0)
        if lone and e2e > 0:
            quota = CpuQuota(min(share, 1.0), period_s)  # a fresh period's budget
            paths.append(ttft - quota.run(0.0, used * ttft / e2e))
        return used / (share - background)

    samples: dict[tuple[int, int], list[float]] = {}
    decodes: list[float] = []
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        await _ttft(client, url, model, tokens(16))  # first request: lazy set-up
        for _ in range(repeats):
            for length in COLD_LENGTHS:
                prompt = tokens(length)
                cold = await timed(client, prompt, lone=length == COLD_LENGTHS[0])
                samples.setdefault((0, length), []).append(cold)
                cached = length // block_size * block_size
                warm = await timed(client, prompt + tokens(EXTENSION_TOKENS))
                new = length + EXTENSION_TOKENS - cached
                samples.setdefault((cached, new), []).append(warm)
            if cpu:
                one = await timed(client, tokens(32))
                many = await timed(client, tokens(32), DECODE_TOKENS)
                decodes.append(max(0.0, many - one) / (DECODE_TOKENS - 1))
            else:
                first, end = await _ttft(client, url, model, tokens(32), DECODE_TOKENS)
                decodes.append((end - first) / (DECODE_TOKENS - 1))
    points = tuple((k, n, statistics.median(v)) for (k, n), v in sorted(samples.items()))
    decode = max(statistics.median(decodes), MIN_S_PER_TOKEN)
    how = (f"CPU seconds / ({share:g} core less {background:.3f} idle)" if cpu
           else "client-side TTFT")
    source = f"bench.testbed.calibrate: {how} at {url}, median of {repeats}"
    fraction = statistics.median(fractions) if fractions else 1.0
    path = max(0.0, statistics.median(paths)) if paths else 0.0
    calibration = replace(fit(points, decode, name, source), client_path_s=path)
    return PeerSpeed(points, decode, calibration, background, fraction)


@dataclass(frozen=True)
class ForwardCost:
    """An entry's CPU seconds per request, by whether another peer served it."""

    forwarded_cpu_s: float
    local_cpu_s: float
    forwarded: int
    requests: int
    # the client's time to first token, median, by the peer that served (the entry's own
    # included): what a lone forward takes end to end, next to a request served at once
    ttft_by_server_s: dict[str, float] = field(default_factory=dict)
    # the serving peer's CPU seconds per forwarded request, median, by serving peer (those
    # whose CPU was read): what a forward costs the other end
    served_cpu_s: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"forwarded_cpu_s": self.forwarded_cpu_s, "local_cpu_s": self.local_cpu_s,
                "forwarded": self.forwarded, "requests": self.requests,
                "ttft_by_server_s": self.ttft_by_server_s,
                "served_cpu_s": self.served_cpu_s}


async def measure_forward(url: str, model: str, entry_id: str, seed: int, cpu: Clock,
                          requests: int = FORWARD_REQUESTS,
                          servers: Mapping[str, Clock] | None = None) -> ForwardCost:
    """Requests of fresh random prompts one at a time to the entry at `url` (of a
    `random` swarm, nothing else sent to it meanwhile): its CPU seconds per request,
    background taken off, for those another peer served and those it served itself;
    with `servers` (CPU clocks by peer id), each serving peer's too."""
    rng = random.Random(f"{seed}/forward/{url}")
    clocks = {entry_id: cpu, **{p: c for p, c in (servers or {}).items() if p != entry_id}}
    by_kind: dict[bool, list[float]] = {True: [], False: []}
    served: dict[str, list[float]] = {}
    ttfts: dict[str, list[float]] = {}
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        idle_from = {p: c() for p, c in clocks.items()}
        idle_start = trio.current_time()
        await trio.sleep(FORWARD_IDLE_S)
        idle_s = trio.current_time() - idle_start
        background = {p: max(0.0, (c() - idle_from[p]) / idle_s) for p, c in clocks.items()}
        for _ in range(requests):
            prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(FORWARD_PROMPT_TOKENS)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            before, start = {p: c() for p, c in clocks.items()}, trio.current_time()
            got = await stream_completion(client, url, body, TIMEOUT_S)
            await trio.sleep(SETTLE_S)
            if got.error or got.first is None:
                raise RuntimeError(f"forward calibration request to {url} failed: {got.error}")
            wall = trio.current_time() - start
            used = {p: max(0.0, c() - before[p] - background[p] * wall) for p, c in clocks.items()}
            server = got.extension.get("served_by", entry_id)
            by_kind[server != entry_id].append(used[entry_id])
            if server != entry_id and server in clocks:
                served.setdefault(server, []).append(used[server])
            ttfts.setdefault(server, []).append(got.first - got.start)
    if not by_kind[True]:
        raise RuntimeError(f"the entry at {url} forwarded none of {requests} requests")
    local = statistics.median(by_kind[False]) if by_kind[False] else math.nan
    return ForwardCost(statistics.median(by_kind[True]), local, len(by_kind[True]), requests,
                       {server: statistics.median(ts) for server, ts in ttfts.items()},
                       {server: statistics.median(cs) for server, cs in served.items()})


@dataclass(frozen=True)
class GossipCost:
    """CPU seconds per cache summary: its publisher's (beyond the requests that changed
    its cache) and each receiver's (the mean over receivers)."""

    publish_cpu_s: float
    receive_cpu_s: float
    publishes: int  # summaries sent while churning, beyond the idle ones of that window
    publisher: int  # the peer that published (bed order)
    idle_rates: tuple[float, ...] = ()  # every peer's CPU (cores) over the idle windows

    def as_dict(self) -> dict[str, Any]:
        return {"publish_cpu_s": self.publish_cpu_s, "receive_cpu_s": self.receive_cpu_s,
                "publishes": self.publishes, "publisher": self.publisher,
                "idle_rates": list(self.idle_rates)}

    def idle_cores(self, peers: int, interval_s: float) -> float:
        """What one peer of `peers` spends on the idle cadence (a summary of its own and
        one from each other peer per interval): part of its measured background."""
        return (self.publish_cpu_s + (peers - 1) * self.receive_cpu_s) / interval_s


async def _published(client: httpx.AsyncClient, url: str) -> int:
    view = (await client.get(f"{url}/v1/swarm", timeout=TIMEOUT_S)).json()
    counts = view.get("gossip_counts") or {}
    if counts.get("seq") is None:
        raise RuntimeError(f"the peer at {url} reports no gossip counts")
    return int(counts["seq"])


async def measure_gossip(urls: Sequence[str], model: str, publisher: int, seed: int,
                         cpus: Sequence[Clock], interval_s: float,
                         window_s: float = GOSSIP_WINDOW_S) -> GossipCost:
    """GossipCost of a swarm that nothing else is sent to meanwhile (module docstring):
    every peer's idle rate over GOSSIP_CYCLES + 1 idle windows of `window_s`, and
    between them as long of fresh prompts to `publisher`, one every GOSSIP_REQUEST_GAP_S.
    (With one idle window before only, one calibration measured the extra CPU as below
    idle, a cost of 0; with one churning window between two idle ones, another did, on
    11 extra summaries.)"""
    rng = random.Random(f"{seed}/gossip")
    n = len(urls)

    def read() -> tuple[list[float], float]:
        return [cpu() for cpu in cpus], trio.current_time()

    idle_cpu, idle_s = [0.0] * n, 0.0  # every peer's CPU over the idle windows
    churn_cpu, churn_s = [0.0] * n, 0.0  # ... and over the churning ones
    published, requests_cpu = 0, 0.0

    async def idle_window() -> None:
        nonlocal idle_s
        c0, t0 = read()
        await trio.sleep(window_s)
        c1, t1 = read()
        idle_s += t1 - t0
        for i in range(n):
            idle_cpu[i] += c1[i] - c0[i]

    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        await idle_window()
        for _ in range(GOSSIP_CYCLES):  # churn between idle windows: a drift or a burst
            seq0 = await _published(client, urls[publisher])  # in one window weighs less
            c2, t2 = read()
            while trio.current_time() < t2 + window_s:
                prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(GOSSIP_PROMPT_TOKENS)]
                before = cpus[publisher]()
                await _ttft(client, urls[publisher], model, prompt)
                requests_cpu += cpus[publisher]() - before
                await trio.sleep(GOSSIP_REQUEST_GAP_S)
            c3, t3 = read()
            published += await _published(client, urls[publisher]) - seq0
            churn_s += t3 - t2
            for i in range(n):
                churn_cpu[i] += c3[i] - c2[i]
            await idle_window()
    idle = [c / idle_s for c in idle_cpu]
    window = churn_s
    extra = published - window / interval_s
    if extra < 1:
        raise RuntimeError(f"the peer at {urls[publisher]} sent {published} summaries in "
                           f"{window:.0f} s of requests: no more than its idle ones")
    used = [c - rate * window for c, rate in zip(churn_cpu, idle, strict=True)]
    receivers = [used[i] for i in range(n) if i != publisher]
    return GossipCost(
        publish_cpu_s=max(0.0, used[publisher] - requests_cpu) / extra,
        receive_cpu_s=max(0.0, statistics.fmean(receivers)) / extra if receivers else 0.0,
        publishes=round(extra), publisher=publisher, idle_rates=tuple(idle),
    )


def usable_cores(share: float, background_cores: float) -> float:
    """What a peer's quota leaves its requests: the share less the idle peer's own CPU
    (the whole share where that measurement broke: more background than share)."""
    return share - background_cores if share > background_cores else share


def served_extra_cpu(speeds: Sequence[PeerSpeed], shares: Sequence[float],
                     peer_ids: Sequence[str], forward: ForwardCost) -> list[float]:
    """Per peer (bed order), the CPU seconds a forwarded request cost it beyond what its
    calibration gives the same request from its own client (a cold FORWARD_PROMPT_TOKENS
    prompt, one token), at least 0; a peer that served no forward while measured gets the
    median of the others' (the same code on the same machine)."""
    extra: dict[int, float] = {}
    for i, peer_id in enumerate(peer_ids):
        cpu = forward.served_cpu_s.get(peer_id)
        if cpu is not None:
            usable = usable_cores(shares[i], speeds[i].background_cores)
            local = speeds[i].calibration.prefill_s(FORWARD_PROMPT_TOKENS, 0) * usable
            extra[i] = cpu - local
    fallback = statistics.median(extra.values()) if extra else 0.0
    return [max(0.0, extra.get(i, fallback)) for i in range(len(peer_ids))]


def with_overheads(speed: PeerSpeed, share: float, forward_cpu_s: float,
                   gossip: GossipCost | None = None,
                   served_extra_cpu_s: float = 0.0) -> Calibration:
    """`speed`'s calibration with the simulator's per-request overheads (module
    docstring): the fit's fixed term less a lone step's fixed cost, the part before the
    first token what `first_token_fraction` of the fixed term leaves after the step;
    a forward's CPU at the entry, what serving a forwarded request costs beyond a local
    one (`served_extra_cpu`) and, with `gossip`, a summary's at its publisher and at a
    receiver, each over this peer's share less its background."""
    cal = speed.calibration
    lone_step = cal.decode_s_per_token * (1.0 - cal.batch_step_slope)
    overhead = max(0.0, cal.prefill_fixed_s - lone_step)
    before = min(overhead, max(0.0, speed.first_token_fraction * cal.prefill_fixed_s
                               - lone_step))
    usable = usable_cores(share, speed.background_cores)
    return replace(cal, request_overhead_s=before, request_tail_s=overhead - before,
                   forward_overhead_s=forward_cpu_s / usable,
                   served_overhead_s=served_extra_cpu_s / usable,
                   summary_publish_s=gossip.publish_cpu_s / usable if gossip else 0.0,
                   summary_receive_s=gossip.receive_cpu_s / usable if gossip else 0.0)


def fit(points: Sequence[tuple[int, int, float]], decode_s_per_token: float, name: str,
        source: str) -> Calibration:
    """The simulator's three-term fit; where noise makes a term negative (a tiny model's
    attention term is within the noise), the two-term fit fixed + per_token * new."""
    try:
        return Calibration.from_points(list(points), decode_s_per_token, name, source)
    except ValueError:
        pass
    xs = [float(n) for _, n, _ in points]
    ys = [t for _, _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(slope, MIN_S_PER_TOKEN)
    fixed = max(0.0, my - slope * mx)
    return Calibration(name, fixed, slope, 0.0, decode_s_per_token, source + " (two-term fit)")


async def measure_peers(urls: Sequence[str], model: str, names: Sequence[str], seed: int,
                        cpus: Sequence[Clock] | None = None,
                        shares: Sequence[float] | None = None,
                        effort: Effort = Effort(),
                        backgrounds: Sequence[float] | None = None,
                        period_s: float = DEFAULT_PERIOD_S) -> list[PeerSpeed]:
    """Every peer's speed, one after another (by CPU seconds over share less its
    background, `backgrounds`, where `cpus` are given; `period_s`: their CFS period)."""
    shares = shares or [1.0] * len(urls)
    backgrounds = backgrounds or [0.0] * len(urls)
    return [await measure_peer(url, model, names[i], seed, cpus[i] if cpus else None,
                               shares[i], repeats=effort.repeats, background=backgrounds[i],
                               period_s=period_s)
            for i, url in enumerate(urls)]
