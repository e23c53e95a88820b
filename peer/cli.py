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
import enum
import functools
import json
import math
import os
import signal
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import trio

from peer.cli_clients import EXIT_FAILURE, run_generate, run_status
from peer.cli_clients import say as _say
from peer.config import DEFAULT_CACHE_BYTES, DEFAULT_MODEL, PeerConfig, Policy
from peer.engine.compute_thread import compute_thread
from peer.local_swarm import LOCAL_SUMMARY_INTERVAL_S
from peer.logs import root_cause, setup_logging
from peer.settings import (
    DEFAULT_CONFIG_FILE,
    DEFAULT_HTTP,
    FIELD_HELP,
    LOG_LEVELS,
    TUNING_SETTINGS,
    ServeOptions,
    config_file_path,
    env_for,
    field_default,
    flag_for,
    is_tuple,
    load_settings,
    parse_bytes,
    settings_fields,
    split_host_port,
    to_toml,
)
from peer.version import version
from protocols.errors import RemoteProtocolError
from protocols.invite import Invite

__all__ = ["build_parser", "config_from_args", "main", "split_host_port"]

API_KEY_ENV = "PREFIXSWARM_API_KEY"  # the key from the environment keeps it out of `ps`
DEFAULT_URL = "http://127.0.0.1:8000"
PEERS_REPORT_INTERVAL_S = 0.2  # how often `--report json` looks at which peers are known:
PEERS_REPEAT_S = 5.0  # it says so when that changed, and at least this often
JOIN_POLL_S = 0.25  # how often `serve` looks whether the first other peer has arrived
MODEL_QUERY_TIMEOUT_S = 10.0  # one small frame each way with a bootstrap peer
EXIT_CONFIG = 2  # a configuration error, found before anything ran (argparse uses 2 too)


class BootstrapFailed(Exception):
    """No bootstrap peer answered within bootstrap_timeout_s."""


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


# -- serve ---------------------------------------------------------------------------------


def settings_from_args(args: argparse.Namespace) -> tuple[PeerConfig, ServeOptions]:
    """Flags given on the command line over PREFIXSWARM_* over the config file."""
    flags = {f.name: getattr(args, f.name) for f, _ in settings_fields() if hasattr(args, f.name)}
    return load_settings(flags, config_file_path(getattr(args, "config", None), os.environ))


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    return settings_from_args(args)[0]


async def _stop_on(waiter: Callable[[], Any], scope: trio.CancelScope) -> None:
    await waiter()
    scope.cancel()


async def _until_stdin_closes() -> None:
    while await trio.to_thread.run_sync(  # type: ignore[call-arg]
        sys.stdin.buffer.readline, abandon_on_cancel=True
    ):
        pass


async def _watch_join(peer: Any, config: PeerConfig) -> None:
    """Fail when no bootstrap peer answers in time; say "joined: N peers" once others show."""
    if config.bootstrap:
        timeout = config.bootstrap_timeout_s or math.inf
        with trio.move_on_after(timeout):
            await peer.discovery.wait_bootstrapped()
        if peer.discovery.bootstrapped:
            await check_bootstrap_models(peer, config)
        else:
            errors = peer.discovery.bootstrap_errors
            causes = [
                f"{addr.split('/p2p/')[0]}: {root_cause(errors[peer_id])}"
                for addr in config.bootstrap
                if (peer_id := addr.rsplit("/p2p/", 1)[1]) in errors
            ]
            raise BootstrapFailed(
                f"none of the {len(config.bootstrap)} bootstrap peers answered within "
                f"{config.bootstrap_timeout_s:g} s ({'; '.join(causes) or 'no answer'}); check "
                "the address, or leave out --bootstrap to start a new swarm"
            )
    else:
        invite = peer.invite()
        how = f"others join it with: prefixswarm serve --join {invite}" if invite else (
            "others join it with the invite `prefixswarm status` prints once this peer has "
            "a dialable address"
        )
        _say(f"no --bootstrap: started a new swarm; {how}")
    while not (others := peer.table.views(trio.current_time())):
        await trio.sleep(JOIN_POLL_S)
    _say(f"joined: {len(others) + 1} peers")


def _load_engine(config: PeerConfig) -> Any:
    """Load the model and warm the engine up, each stage said on stderr (blocking)."""
    from peer.engine.engine import load_engine
    from peer.progress import Bar, stage

    engine = load_engine(
        config.model, config.cache_bytes, config.block_size, warmup=False,
        **config.load_options(),
    )
    with stage("warming up the engine (measuring its speeds)"):
        bar = Bar("warm-up")  # on a terminal only
        try:
            engine.warmup(bar.update)
        finally:
            bar.close()
    return engine


class ModelMismatch(Exception):
    """Every bootstrap peer that answered serves another model (or weights, or dtype)."""


async def check_bootstrap_models(peer: Any, config: PeerConfig) -> None:
    """Stop with one line when the bootstrap peers serve another model: such peers never
    see each other (the model id names the topic), so waiting for them is pointless."""
    from libp2p.exceptions import BaseLibp2pError

    from peer.net.wire import PeerUnreachable, StreamRefused
    from peer.routing.probe_service import query_model

    theirs: dict[str, str] = {}
    for addr in config.bootstrap:
        peer_id = addr.rsplit("/p2p/", 1)[-1]
        try:
            theirs[peer_id] = await query_model(
                peer.host, peer_id, peer.model_id, MODEL_QUERY_TIMEOUT_S
            )
        except (PeerUnreachable, StreamRefused, RemoteProtocolError, BaseLibp2pError):
            continue  # not connected yet, or a peer that does not answer: no verdict
    others = {pid: model for pid, model in theirs.items() if model and model != peer.model_id}
    if theirs and len(others) == len(theirs):
        pid, model = next(iter(others.items()))
        raise ModelMismatch(
            f"bootstrap peer {pid[:16]}... serves {model}, this peer {peer.model_id}: peers of "
            "different models (or weights, or dtype) cannot share a swarm; check --model "
            "and --dtype, or join with that swarm's invite"
        )


class InviteMismatch(Exception):
    """The model loaded is not the one the --join invite's swarm serves."""


def check_invite_model(invite: Invite | None, model_id: str) -> None:
    """Peers with different models (or weights) cannot share a swarm: say so and stop."""
    if invite is not None and invite.model_id != model_id:
        raise InviteMismatch(
            f"the invite's swarm serves {invite.model_id}, but this peer loaded {model_id}: "
            f"give --model and --dtype of that model, or leave them out to use the invite's"
        )


async def _report_up(
    peer: Any, url: str | None, json_report: bool, scope: trio.CancelScope
) -> None:
    """Say the peer is up: JSON lines (then its known peers now and then), or text."""
    from peer import views  # loaded by now: the peer is up
    with scope:
        if not json_report:
            print(f"peer {peer.peer_id} serves {peer.model_id}; others join with:")
            invite = peer.invite()
            if invite:
                print(f"  prefixswarm serve --join {invite}")
            else:
                print("  (no dialable address yet: behind NAT, see docs/joining.md)")
            print("reachability is checked with the first peers; a line follows.")
            if url:
                print(f"HTTP API (OpenAI-compatible): {url}/v1")
            sys.stdout.flush()
            return
        _emit(
            {
                "event": "up", "pid": os.getpid(), "peer_id": peer.peer_id,
                "multiaddrs": peer.multiaddrs, "http": url, "model": peer.model_id,
                "reachability": peer.reachability,
            }
        )
        last: dict[str, Any] = {}
        said_at = -math.inf
        while True:
            report = views.peers_report(peer.table.views(trio.current_time()))
            now = trio.current_time()
            if report != last or now - said_at >= PEERS_REPEAT_S:
                _emit(report)
                last, said_at = report, now
            await trio.sleep(PEERS_REPORT_INTERVAL_S)


async def run_serve(args: argparse.Namespace, config: PeerConfig, options: ServeOptions) -> None:
    """Load the model, start the peer (and its HTTP API), run until a signal or EOF."""
    from peer.api.http import serve_http
    from peer.node import open_peer

    json_report = args.report == "json"
    up, leaving = trio.Event(), trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                """The first signal drains a peer that is up; any other stops at once."""
                async for _ in signals:
                    if not up.is_set() or leaving.is_set():
                        break
                    leaving.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signals)
            if args.exit_with_stdin:
                nursery.start_soon(_stop_on, _until_stdin_closes, nursery.cancel_scope)
            if json_report:
                _emit({"event": "loading", "model": config.model, "pid": os.getpid()})
            else:
                _say(f"loading model {config.model}...")
            started = trio.current_time()
            engine = await trio.to_thread.run_sync(  # type: ignore[call-arg]
                compute_thread().call, _load_engine, config,
                abandon_on_cancel=True,  # a signal during loading stops the process at once
            )
            _say(f"model {engine.model_id} ready in {trio.current_time() - started:.1f} s")
            check_invite_model(options.invite, engine.model_id)
            async with open_peer(config, engine=engine) as peer, trio.open_nursery() as faces:
                url = None
                if options.http:  # returns once drained: its requests end before the peer
                    host, port = split_host_port(options.http)
                    serve = functools.partial(
                        serve_http, api_key=options.api_key, drain=leaving,
                        drain_timeout_s=options.drain_timeout_s,
                    )
                    url = await faces.start(serve, peer, host, port)
                nursery.start_soon(_watch_join, peer, config)
                reports = trio.CancelScope()
                faces.start_soon(_report_up, peer, url, json_report, reports)
                up.set()
                await leaving.wait()
                _say(f"leaving: finishing the requests in flight (at most "
                     f"{options.drain_timeout_s:g} s; a second signal stops at once)")
                cut = await peer.drain(options.drain_timeout_s)
                if cut:
                    _say(f"drain timeout: {cut} requests in flight were cut off")
                reports.cancel()
            nursery.cancel_scope.cancel()
    if json_report:
        _emit({"event": "down", "pid": os.getpid()})


def serve(args: argparse.Namespace) -> int:
    """`serve`: settings, checks before the model loads, then the peer under its lock."""
    from peer.preflight import check_serve, hold_identity

    config, options = settings_from_args(args)
    if args.print_config:
        sys.stdout.write(to_toml(config, options))
        return 0
    setup_logging(options.log_level)
    check_serve(config, options)
    with hold_identity(config.identity_file):
        trio.run(run_serve, args, config, options)
    return 0


# -- argument parsing --------------------------------------------------------------------


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return "none" if value is None else (str(value) or "''")


def _metavar(name: str, hint: Any) -> str:
    if isinstance(hint, types.UnionType):  # `int | None` is shown as an int
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if name.endswith("addrs") or name == "bootstrap":
        return "MULTIADDR"
    if name == "join":
        return "INVITE"
    suffixes = {"_s": "S", "_bytes": "BYTES", "_file": "FILE", "http": "HOST:PORT", "_key": "KEY"}
    for suffix, metavar in suffixes.items():
        if name.endswith(suffix):
            return metavar
    return {int: "N", float: "X"}.get(hint, "NAME")


class HelpAll(argparse.Action):
    """`--help-all`: the help with every flag, the knobs `--help` leaves out included."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=0, help="show every flag, tuning and benchmark knobs included")
        self.hidden: list[tuple[argparse.Action, str]] = []  # each with the help it hides

    def hide(self, action: argparse.Action) -> None:
        """Leave `action` out of --help (it still parses), listed by --help-all."""
        self.hidden.append((action, action.help or ""))
        action.help = argparse.SUPPRESS

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        for action, text in self.hidden:
            action.help = text
        parser.print_help()
        parser.exit()


def add_setting_flags(parser: argparse.ArgumentParser, help_all: HelpAll | None = None) -> None:
    """A flag for every setting (PeerConfig and ServeOptions fields), derived from them;
    with `help_all`, the TUNING_SETTINGS ones go to its list, in their own group."""
    tuning = parser.add_argument_group("tuning and benchmarks (listed by --help-all)")
    for f, hint in settings_fields():
        text = FIELD_HELP.get(f.name, f.name.replace("_", " "))
        shown = _shown(field_default(f))
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,  # unset flags leave the value to env/file/default
            "help": f"{text} (default: {shown}; env {env_for(f.name)})".replace("%", "%%"),
        }
        if is_tuple(hint):
            kwargs.update(nargs="+", action="extend")
        elif hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            kwargs["choices"] = [m.value for m in hint]
        elif f.name == "log_level":
            kwargs.update(choices=LOG_LEVELS, type=str.lower)
        if "choices" not in kwargs and hint is not bool:
            kwargs["metavar"] = _metavar(f.name, hint)
        if help_all is not None and f.name in TUNING_SETTINGS:
            help_all.hide(tuning.add_argument(flag_for(f.name), **kwargs))
        else:
            parser.add_argument(flag_for(f.name), **kwargs)


def _api_key_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"{what} (default ${API_KEY_ENV})")


def _local_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, checkpoint folder or hub id")
    p.add_argument("--cache-bytes", type=parse_bytes, default=DEFAULT_CACHE_BYTES,
                   help="KV cache budget per peer (units: 512MB, 1GiB)")
    p.add_argument("--policy", default=Policy.COST.value, choices=[x.value for x in Policy])
    p.add_argument("--summary-interval", type=float, default=LOCAL_SUMMARY_INTERVAL_S,
                   metavar="S", help="seconds between cache summaries")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS, type=str.lower)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixswarm", description="A P2P swarm serving an LLM with prefix-cache routing."
    )
    parser.add_argument("--version", action="version", version=f"prefixswarm {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter
    serve_parser = sub.add_parser(
        "serve", help="start a swarm, or join one with --bootstrap", formatter_class=defaults,
        conflict_handler="resolve",  # a flag added by hand for a field replaces the derived one
        description="Every setting is also read from PREFIXSWARM_<NAME> variables and from a "
        "TOML file (--config, $PREFIXSWARM_CONFIG or ~/.config/prefixswarm/config.toml); "
        "flags win over variables, variables over the file. --help-all also lists the "
        "tuning and benchmark knobs.",
    )
    help_all = typing.cast(HelpAll, serve_parser.add_argument("--help-all", action=HelpAll))
    add_setting_flags(serve_parser, help_all)
    serve_parser.add_argument(
        "--config", default=argparse.SUPPRESS, metavar="FILE",
        help=f"TOML file of settings ('none': no file) (default: $PREFIXSWARM_CONFIG, else "
        f"{DEFAULT_CONFIG_FILE} if it exists)",
    )
    serve_parser.add_argument("--print-config", action="store_true",
                              help="print the settings in effect as a config file, and exit")
    for_programs = serve_parser.add_argument_group("for programs that start peers")
    help_all.hide(for_programs.add_argument(
        "--report", choices=["text", "json"], default="text",
        help="json: one JSON object a line on stdout, for programs"))
    help_all.hide(for_programs.add_argument("--exit-with-stdin", action="store_true",
                                            help="stop when stdin closes"))

    gen = sub.add_parser("generate", help="send a prompt to a running peer, stream the answer",
                         formatter_class=defaults)
    gen.add_argument("prompt", help="the prompt ('-' reads stdin)")
    gen.add_argument("--url", default=DEFAULT_URL, help="a peer's HTTP API")
    gen.add_argument("--chat", action="store_true", help="as a chat message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--model", default=None, help="model name (default: the peer's)")
    _api_key_option(gen, "the peer's API key")

    status = sub.add_parser("status", help="the peer's view of the swarm",
                            formatter_class=defaults)
    status.add_argument("--url", default=DEFAULT_URL, help="a peer's HTTP API")
    status.add_argument("--json", action="store_true", help="the raw /v1/swarm object")
    _api_key_option(status, "the peer's API key")

    local = sub.add_parser("local", help="run N peers on this machine (loopback)",
                           formatter_class=defaults)
    _local_options(local)
    local.add_argument("--peers", type=int, default=3, help="processes to start")
    local.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                       help="the first peer's HTTP API (the others take free ports)")
    local.add_argument("--demo", action="store_true", help="send MMLU questions, print, exit")
    local.add_argument("--json", action="store_true", help="a JSON 'ready' line on stdout")
    local.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                       help="seconds to wait for every peer")
    return parser


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix: shown as one line each, never a traceback."""
    from peer.engine.api import ModelLoadError

    errors: tuple[type[BaseException], ...] = (
        ValueError, ModelLoadError, BootstrapFailed, InviteMismatch, ModelMismatch,
    )
    if "peer.net.host" in sys.modules:  # imported by `serve` only; importing it loads libp2p
        errors += (sys.modules["peer.net.host"].HostError,)
    return errors


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub unasked
    try:
        if args.command == "serve":
            return serve(args)
        setup_logging(getattr(args, "log_level", "warning"))
        if args.command == "generate":
            return run_generate(args)
        if args.command == "status":
            return run_status(args)
        from peer.local_swarm import run_local

        return trio.run(run_local, args)
    except Exception as exc:  # sorted below: anything not the user's to fix is re-raised
        leaves = _leaves(exc)
        if not all(isinstance(leaf, _user_errors()) for leaf in leaves):
            raise
        for line in dict.fromkeys(" ".join(str(leaf).split()) for leaf in leaves):  # one line
            _say(line)
        config_only = all(isinstance(leaf, ValueError) for leaf in leaves)
        return EXIT_CONFIG if config_only else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
