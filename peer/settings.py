"""Layered configuration: flags > PREFIXSWARM_* environment > TOML file > defaults.

    config, options = load_settings(flags={"cache_bytes": "2GiB"}, config_file=None)

Every PeerConfig field (and every ServeOptions field) is settable all three ways; the
flag, variable and file key are derived from the dataclass field, so a new field needs
only its line in PeerConfig (FIELD_HELP gives it a --help text; TUNING_SETTINGS moves it
to --help-all). pydantic-settings parses the sources and coerces types;
PeerConfig.__post_init__ checks the values. Any problem is one ConfigError line that
names where the bad value came from.

Conventions: an int field whose name ends in `_bytes` accepts units ("1GiB", "512MB");
a tuple field takes a list (TOML), or commas/whitespace (environment); a path field takes
"none" for no file; a bool field gets --NAME/--no-NAME.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ByteSize, TypeAdapter, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from peer.config import PeerConfig
from protocols.ids import split_model_id
from protocols.invite import Invite, InviteError, decode_invite

ENV_PREFIX = "PREFIXSWARM_"
CONFIG_ENV = "PREFIXSWARM_CONFIG"  # the config file, when --config is not given
DEFAULT_CONFIG_FILE = "~/.config/prefixswarm/config.toml"  # read when it exists
DEFAULT_HTTP = "127.0.0.1:8000"  # loopback only: the API has no authentication
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_BOOTSTRAP_FILE_BYTES = 1 << 20  # a list of multiaddrs; anything bigger is a mistake
PUBLIC_BOOTSTRAP_FILE = "public_bootstrap.txt"  # package data, versioned with the code
MAX_DRAIN_TIMEOUT_S = 3600.0  # a service manager waits no longer than this to stop a peer

# Flags whose name is not the field name minus its `_s` unit suffix.
FLAG_NAMES = {
    "listen_addrs": "listen",
    "announce_addrs": "announce",
    "identity_file": "identity",
    "served_model_names": "served-model-name",
    "use_relays": "relays",  # --relays/--no-relays
}
FIELD_HELP = {
    "model": "alias (smollm2-135m, tiny-random), checkpoint folder or hub id",
    "listen_addrs": "multiaddrs to listen on",
    "announce_addrs": "addresses to tell others (behind NAT: your public address)",
    "bootstrap": "peer multiaddrs (/ip4/.../tcp/.../p2p/<id>) of a swarm to join",
    "identity_file": "ed25519 key file, created if missing ('none': ephemeral)",
    "cache_bytes": "KV prefix cache budget (units: 512MB, 1GiB)",
    "block_size": "tokens per KV block",
    "summary_interval_s": "seconds between cache summaries",
    "bloom_fp_rate": "false-positive rate of the gossiped Bloom summary",
    "policy": "routing policy",
    "gossip_mode": "how summaries travel: full (every peer) or ring (bounded neighbours)",
    "gossip_neighbours": "ring gossip mode: the peers whose summaries this peer hears",
    "lookup_wait_s": "ring gossip mode: seconds a request may wait to find holders beyond "
    "the ring (0: no lookup)",
    "max_queue": "waiting requests before answering 429 overloaded",
    "max_inbound_per_peer": "concurrent forwarded requests accepted from one peer",
    "identity_share": "share of this engine's time one other peer may use",
    "remote_share": "share of this engine's time all other peers together may use",
    "forward_first_token_s": "seconds a forward may take to its first token",
    "forward_token_gap_s": "seconds a forwarded stream may stay silent between tokens",
    "request_timeout_s": "end-to-end deadline when the client gives none",
    "bootstrap_timeout_s": "seconds to reach a bootstrap peer before giving up (0: forever)",
    "served_model_names": "extra names the HTTP API accepts for the model",
    "verify_fraction": "share of forwarded responses verified before delivery",
    "probation_requests": "matching shadow answers before a new peer is trusted (0: none)",
    "quarantine_file": "quarantined peers (none: quarantine.json next to the identity)",
    "probation_share": "at most 1 request in N carries a shadow copy to a peer on "
    "probation",
    "first_token_multiple": "a forward's first-token deadline as a multiple of its estimate",
    "first_token_floor_s": "the shortest first-token deadline of a forward",
    "hedge_multiple": "no first token after this multiple of the estimate: try the next "
    "candidate too (0: no hedging)",
    "hedge_floor_s": "the earliest a hedge starts",
    "load_probes": "candidates asked for their load before forwarding (0: gossiped load only)",
    "load_probe_wait_s": "the longest a request waits for load probes",
    "dtype": "weights and KV precision: auto (int4 for the embedded smollm2-135m on a CPU "
             "with native bfloat16 and AVX-512; else bfloat16 where the CPU or GPU computes "
             "it natively, else float32), float32, bfloat16, int8 or int4 (weight-only, CPU; "
             "bfloat16 activations); float16 needs a GPU",
    "device": "auto, cpu, cuda or mps",
    "threads": "torch CPU threads (none: torch's default)",
    "compile_decode": "compile a lone request's decode step at start-up (CPU, Llama models; "
                      "one to three minutes on two cores)",
    "attention": "attention kernel: auto (fixed in int8 and int4, sdpa otherwise), sdpa, or "
                 "fixed (every row rounded alike in any batch: batched and cached answers "
                 "equal sequential ones where the products are row-invariant; slower)",
    "revision": "a hub id's branch, tag or commit",
    "max_model_len": "cap the context (prompt + output tokens) below the model's own",
    "chat_template": "a Jinja file replacing the tokenizer's chat template",
    "relay_service": "relay for peers behind NAT when this peer is reachable",
    "use_relays": "behind NAT, reserve relay slots (without them nobody reaches you)",
    "mdns": "find and announce peers on the local network (multicast DNS)",
    "upnp": "ask the router (UPnP) to forward the listen port",
    "http": "serve the HTTP API at HOST:PORT ('' to disable)",
    "log_level": "log level",
    "bootstrap_file": "file of bootstrap multiaddrs, one a line ('#' comments)",
    "join": "an invite string (printed by `prefixswarm status` and on the page): joins that "
    "swarm with its model",
    "insecure_no_api_key": "serve the HTTP API beyond loopback without an API key (anyone who "
    "reaches it can use this peer)",
    "drain_timeout_s": "on SIGTERM, seconds the requests in flight may take to finish",
    "public": "join the public swarm: the bootstrap list shipped with this version",
    "swarm_name": "a name for the swarm, carried in this peer's invites",
    "api_key": "require 'Authorization: Bearer KEY' on every HTTP path but /health and the "
    "page (prefer the variable: a flag shows in `ps`)",
}

# Tuning and benchmark knobs: accepted as flags, variables and file keys like every
# setting, but listed by `serve --help-all` only, so `--help` shows what a volunteer needs.
TUNING_SETTINGS = frozenset({
    "block_size", "summary_interval_s", "bloom_fp_rate", "gossip_mode", "gossip_neighbours",
    "policy", "max_queue", "max_inbound_per_peer", "identity_share", "remote_share",
    "forward_first_token_s",
    "forward_token_gap_s", "request_timeout_s", "bootstrap_timeout_s", "served_model_names",
    "verify_fraction", "probation_requests", "probation_share",
    "quarantine_file", "first_token_multiple", "first_token_floor_s", "hedge_multiple",
    "hedge_floor_s", "load_probes", "load_probe_wait_s", "lookup_wait_s",
})  # fmt: skip


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line naming its source."""


def split_host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as '[::1]:PORT') -> (host, port); ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:8000), got {value!r}")
    return host.strip("[]"), int(port)


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or address, without a port) names this machine's loopback."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeOptions:
    """What `serve` needs besides PeerConfig; settable the same three ways."""

    http: str = DEFAULT_HTTP
    log_level: str = "warning"
    bootstrap_file: Path | None = None
    api_key: str | None = None  # None: the HTTP API is open (it listens on loopback by default)
    join: str | None = None  # an invite (protocols/invite.py): its bootstrap and model
    drain_timeout_s: float = 30.0  # SIGTERM: how long the requests in flight may take
    insecure_no_api_key: bool = False  # serve HTTP beyond loopback without a key anyway
    public: bool = False  # the shipped public bootstrap list (peer/public_bootstrap.txt)

    def __post_init__(self) -> None:
        if self.http:
            try:
                split_host_port(self.http)
            except ValueError as exc:
                raise ValueError(f"http address: {exc}") from None
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if not 0 <= self.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
            raise ValueError(f"drain_timeout_s must be in [0, {MAX_DRAIN_TIMEOUT_S:g}]")
        if self.join is not None:
            decode_invite(self.join)  # InviteError (a ValueError) says what is wrong

    @property
    def invite(self) -> Invite | None:
        """The decoded `join` invite, if any."""
        return decode_invite(self.join) if self.join is not None else None


SETTINGS_CLASSES: tuple[type[PeerConfig], type[ServeOptions]] = (PeerConfig, ServeOptions)


def flag_for(name: str) -> str:
    return "--" + FLAG_NAMES.get(name, name.removesuffix("_s")).replace("_", "-")


def env_for(name: str) -> str:
    return ENV_PREFIX + name.upper()


def settings_fields() -> list[tuple[dataclasses.Field[Any], Any]]:
    """Every settable field with its resolved type, PeerConfig's first."""
    out = []
    for cls in SETTINGS_CLASSES:
        hints = typing.get_type_hints(cls)
        out += [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]
    return out


def field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def _split_words(value: Any) -> Any:
    """A string from the environment -> its comma/whitespace separated parts; the lone
    word 'none' (e.g. `--listen none`: an outbound-only peer) -> an empty tuple."""
    if isinstance(value, str):
        value = tuple(value.replace(",", " ").split())
    if isinstance(value, (tuple, list)) and [str(v).lower() for v in value] == ["none"]:
        return ()
    return value


def _none_word(value: Any) -> Any:
    return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _is_optional(hint: Any) -> bool:
    """`X | None`: the word 'none' (or '') stands for None in flags, variables and files."""
    return isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)


def settings_type(name: str, hint: Any) -> Any:
    """The type pydantic parses a field's raw value as (the unit conventions above)."""
    if hint is int and name.endswith("_bytes"):
        return ByteSize
    if is_tuple(hint):
        return Annotated[hint, NoDecode, BeforeValidator(_split_words)]
    if _is_optional(hint):
        return Annotated[hint, BeforeValidator(_none_word)]
    if name == "log_level":
        return Annotated[hint, BeforeValidator(_lower)]
    return hint


def parse_bytes(value: str | int) -> int:
    """'1GiB' -> 1073741824, '512MB' -> 512000000, '1000' -> 1000; ValueError otherwise."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError as exc:
        raise ValueError(f"not a byte size: {value!r} (e.g. 1000, 512MB, 1GiB)") from exc


class _LayeredSettings(BaseSettings):
    """Flags (init values) > environment > TOML file; unknown file keys are errors."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls.model_config.get("toml_file"):
            sources.append(TomlConfigSettingsSource(settings_cls))
        return tuple(sources)


def _settings_model(toml_file: Path | None) -> type[BaseSettings]:
    definitions: dict[str, Any] = {
        f.name: (settings_type(f.name, hint), field_default(f)) for f, hint in settings_fields()
    }
    model: type[BaseSettings] = create_model(
        "PrefixswarmSettings", __base__=_LayeredSettings, **definitions
    )
    if toml_file is not None:
        config = SettingsConfigDict(**{**model.model_config, "toml_file": toml_file})
        model = type("PrefixswarmFileSettings", (model,), {"model_config": config})
    return model


def config_file_path(explicit: str | None, environ: Mapping[str, str]) -> Path | None:
    """--config, else $PREFIXSWARM_CONFIG, else the default file when it exists."""
    named = explicit if explicit is not None else environ.get(CONFIG_ENV)
    if named is not None:
        if named.strip().lower() in ("", "none"):
            return None
        path = Path(os.path.expanduser(named))
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        return path
    default = Path(os.path.expanduser(DEFAULT_CONFIG_FILE))
    return default if default.is_file() else None


def _where(name: str, flags: Mapping[str, Any], file: Path | None) -> str:
    if name in flags:
        return flag_for(name)
    if env_for(name) in os.environ:
        return env_for(name)
    if file is not None:
        return f"{file}: {name}"
    return name


def _decode_join(text: str) -> Invite:
    try:
        return decode_invite(text)
    except InviteError as exc:
        raise ConfigError(f"--join: {exc}") from None


def public_bootstrap() -> tuple[str, ...]:
    """The public swarm's bootstrap list shipped with this version; ConfigError while it
    lists no peer (none are public yet)."""
    text = resources.files("peer").joinpath(PUBLIC_BOOTSTRAP_FILE).read_text()
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    addrs = tuple(line for line in lines if line)
    if not addrs:
        raise ConfigError(
            f"--public: the bootstrap list shipped with this version (peer/{PUBLIC_BOOTSTRAP_FILE})"
            " lists no public peers yet; join with an invite (--join) or --bootstrap"
        )
    return addrs


def read_bootstrap_file(path: Path) -> tuple[str, ...]:
    """One multiaddr a line; blank lines and '#' comments are skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BOOTSTRAP_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read bootstrap file {path}: {exc.strerror}") from exc
    if len(data) > MAX_BOOTSTRAP_FILE_BYTES:
        raise ConfigError(f"bootstrap file {path} is over {MAX_BOOTSTRAP_FILE_BYTES} bytes")
    lines = (line.split("#", 1)[0].strip() for line in data.decode(errors="replace").splitlines())
    return tuple(line for line in lines if line)


def load_settings(
    flags: Mapping[str, Any] | None = None, config_file: Path | None = None
) -> tuple[PeerConfig, ServeOptions]:
    """Merge the sources, validate once; ConfigError (one line) on any bad value."""
    flags = dict(flags or {})
    try:
        settings = _settings_model(config_file)(**flags)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "?"
        where = _where(name, flags, config_file)
        shown = first.get("input")
        raise ConfigError(f"{where}: {first['msg']} (got {shown!r})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {config_file}: not valid TOML: {exc}") from None
    values = {name: getattr(settings, name) for name in type(settings).model_fields}
    values = {k: int(v) if isinstance(v, ByteSize) else v for k, v in values.items()}
    peer_cls, serve_cls = SETTINGS_CLASSES
    peer_values = {f.name: values[f.name] for f in dataclasses.fields(peer_cls) if f.init}
    serve_values = {f.name: values[f.name] for f in dataclasses.fields(serve_cls) if f.init}
    if serve_values.get("bootstrap_file") is not None:
        extra = read_bootstrap_file(serve_values["bootstrap_file"])
        peer_values["bootstrap"] = tuple(dict.fromkeys((*peer_values["bootstrap"], *extra)))
    if serve_values.get("public"):
        extra = public_bootstrap()
        peer_values["bootstrap"] = tuple(dict.fromkeys((*peer_values["bootstrap"], *extra)))
    if serve_values.get("join"):
        invite = _decode_join(serve_values["join"])
        peer_values["bootstrap"] = tuple(dict.fromkeys((*peer_values["bootstrap"],
                                                        *invite.bootstrap)))
        if "model" not in settings.model_fields_set:  # the invite's model, unless named
            peer_values["model"], dtype, _ = split_model_id(invite.model_id)
            if "dtype" not in settings.model_fields_set:
                peer_values["dtype"] = dtype
        if invite.name and "swarm_name" not in settings.model_fields_set:
            peer_values["swarm_name"] = invite.name
    try:
        return peer_cls(**peer_values), serve_cls(**serve_values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, enum.Enum):
        value = value.value
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


SECRET_FIELDS = frozenset({"api_key"})


def to_toml(config: PeerConfig, options: ServeOptions) -> str:
    """The settings in effect as a config file (`serve --print-config`); None: 'none'."""
    lines = []
    for obj in (config, options):
        for f in dataclasses.fields(obj):
            if f.init:
                value = getattr(obj, f.name)
                if f.name in SECRET_FIELDS and value is not None:
                    value = "(set, not shown)"  # printed configs end up in bug reports
                shown = '"none"' if value is None else _toml_value(value)
                lines.append(f"{f.name} = {shown}")
    return "\n".join(lines) + "\n"
