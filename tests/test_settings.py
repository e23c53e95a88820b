"""Settings: every PeerConfig field by flag, PREFIXSWARM_* variable and TOML file, in that
order of precedence, validated once with one line naming the bad value's source."""

from __future__ import annotations

import dataclasses
import re

import pytest

from peer import cli
from peer.config import PeerConfig, Policy
from peer.settings import (
    TUNING_SETTINGS,
    ConfigError,
    ServeOptions,
    config_file_path,
    env_for,
    flag_for,
    load_settings,
    parse_bytes,
)

PEER_ID = "12D3KooWQ9jhRNWHHQioUtkmgTNTKoKjgvx8oZ3Qts9KdFLoW8Gy"
BOOT = f"/ip4/10.0.0.1/tcp/4001/p2p/{PEER_ID}"
BOOT2 = f"/ip4/10.0.0.2/tcp/4001/p2p/{PEER_ID}"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    """No PREFIXSWARM_* variable or config file of the machine leaks into these tests."""
    import os

    for name in list(os.environ):
        if name.startswith("PREFIXSWARM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_byte_sizes_accept_units():
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1000") == 1000
    assert parse_bytes(7) == 7
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("1XB")


def test_defaults_are_peer_config_defaults():
    config, options = load_settings()
    assert config == PeerConfig()
    assert options == ServeOptions()


def test_precedence_flag_over_env_over_file(monkeypatch, tmp_path):
    file = tmp_path / "c.toml"
    file.write_text('cache_bytes = "2GiB"\nblock_size = 32\nmax_queue = 5\npolicy = "random"\n'
                    f'bootstrap = ["{BOOT}"]\nhttp = ""\n')
    monkeypatch.setenv("PREFIXSWARM_BLOCK_SIZE", "64")
    monkeypatch.setenv("PREFIXSWARM_MAX_QUEUE", "6")
    config, options = load_settings({"max_queue": "7"}, config_file=file)
    assert config.cache_bytes == 2 << 30  # file
    assert config.block_size == 64  # env over file
    assert config.max_queue == 7  # flag over env
    assert config.policy is Policy.RANDOM
    assert config.bootstrap == (BOOT,)
    assert options.http == ""


def test_environment_lists_and_none(monkeypatch):
    monkeypatch.setenv("PREFIXSWARM_BOOTSTRAP", f"{BOOT}, {BOOT2}")
    monkeypatch.setenv("PREFIXSWARM_IDENTITY_FILE", "none")
    monkeypatch.setenv("PREFIXSWARM_CACHE_DIR", "/tmp/elsewhere")  # not a setting: ignored
    monkeypatch.setenv("PREFIXSWARM_LOG_LEVEL", "DEBUG")
    config, options = load_settings()
    assert config.bootstrap == (BOOT, BOOT2)
    assert config.identity_file is None
    assert options.log_level == "debug"


def test_bootstrap_file_adds_to_the_list(tmp_path):
    listing = tmp_path / "swarm.txt"
    listing.write_text(f"# our swarm\n{BOOT2}  # the second\n\n{BOOT}\n")
    config, _ = load_settings({"bootstrap": [BOOT], "bootstrap_file": str(listing)})
    assert config.bootstrap == (BOOT, BOOT2)
    with pytest.raises(ConfigError, match="cannot read bootstrap file"):
        load_settings({"bootstrap_file": str(tmp_path / "missing.txt")})


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"cache_bytes": "1XB"}, {}, r"^--cache-bytes: .*byte unit.*'1XB'"),
        ({}, {"PREFIXSWARM_BLOCK_SIZE": "x"}, r"^PREFIXSWARM_BLOCK_SIZE: .*integer"),
        ({"policy": "fastest"}, {}, r"^--policy: .*'cost'"),
        ({"block_size": "0"}, {}, r"block_size must be in \[1, 1024\]"),
        ({"http": "localhost"}, {}, r"http address: expected HOST:PORT"),
        ({"bootstrap": ["/ip4/1.2.3.4/tcp/1"]}, {}, r"lacks the /p2p/"),
        ({"bootstrap_timeout_s": "-1"}, {}, r"bootstrap_timeout_s must be >= 0"),
    ],
)
def test_bad_values_are_one_line_naming_their_source(monkeypatch, flags, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message) as info:
        load_settings(flags)
    assert "\n" not in str(info.value)


def test_config_file_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("cache_bytes = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(config_file=bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("cache_byte = 5\n")
    with pytest.raises(ConfigError, match=r"typo.toml: cache_byte: Extra inputs"):
        load_settings(config_file=typo)
    with pytest.raises(ConfigError, match="does not exist"):
        config_file_path(str(tmp_path / "nope.toml"), {})
    monkeypatch.setenv("PREFIXSWARM_CONFIG", str(typo))
    assert config_file_path(None, {"PREFIXSWARM_CONFIG": str(typo)}) == typo
    assert config_file_path("none", {"PREFIXSWARM_CONFIG": str(typo)}) is None
    assert config_file_path(None, {}) is None  # no default file in this HOME


def test_every_field_has_a_flag_an_env_variable_and_a_help_default(capsys):
    """A new PeerConfig field gets all three without further code (in --help-all; the
    tuning knobs are left out of --help, tested below)."""
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help-all"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(PeerConfig):
        assert flag_for(f.name) in text
        assert env_for(f.name) in text
    assert "(default: 1073741824; env PREFIXSWARM_CACHE_BYTES)" in text
    args = parser.parse_args(["serve", "--cache-bytes", "512MB", "--served-model-name", "a", "b",
                              "--config", "none"])
    config = cli.config_from_args(args)
    assert config.cache_bytes == 512_000_000
    assert config.served_model_names == ("a", "b")


def _serve_help(capsys, flag: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve", flag])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def _mentions(text: str, flag: str) -> bool:
    """`flag` as a whole flag (--bootstrap is not --bootstrap-file)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


VOLUNTEER_FLAGS = (
    "--model", "--bootstrap", "--bootstrap-file", "--listen", "--announce", "--identity",
    "--http", "--api-key", "--cache-bytes", "--dtype", "--device", "--threads", "--log-level",
    "--config", "--mdns", "--upnp", "--relays", "--print-config", "--help-all",
)  # fmt: skip
KNOB_FLAGS = (
    "--block-size", "--hedge-multiple", "--hedge-floor",
    "--first-token-multiple", "--first-token-floor", "--load-probes", "--load-probe-wait",
    "--bloom-fp-rate", "--max-queue", "--max-inbound-per-peer", "--probation-requests",
    "--probation-share", "--summary-interval", "--policy", "--gossip-mode", "--report",
    "--exit-with-stdin",
)  # fmt: skip


def test_serve_help_shows_a_volunteers_flags_and_help_all_the_knobs(capsys, monkeypatch):
    short, full = _serve_help(capsys, "--help"), _serve_help(capsys, "--help-all")
    for flag in VOLUNTEER_FLAGS:
        assert _mentions(short, flag) and _mentions(full, flag), flag
    for flag in KNOB_FLAGS:
        assert not _mentions(short, flag), f"{flag} is in --help"
        assert _mentions(full, flag), f"{flag} is not in --help-all"
    assert "--help-all also lists the tuning and benchmark knobs" in short
    fields = {f.name for f in dataclasses.fields(PeerConfig)}
    assert fields >= TUNING_SETTINGS  # no misspelt name in the list
    # hidden, not gone: the same flags, variables and file keys set the same settings
    monkeypatch.setenv("PREFIXSWARM_HEDGE_FLOOR_S", "0.3")
    args = cli.build_parser().parse_args([
        "serve", "--config", "none", "--summary-interval", "0.5", "--block-size", "32",
        "--hedge-multiple", "3", "--load-probes", "1", "--report", "json", "--exit-with-stdin",
    ])  # fmt: skip
    config = cli.config_from_args(args)
    assert (config.summary_interval_s, config.block_size, config.hedge_multiple) == (0.5, 32, 3.0)
    assert (config.load_probes, config.hedge_floor_s) == (1, 0.3)
    assert args.report == "json" and args.exit_with_stdin


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("prefixswarm ")


@dataclasses.dataclass(frozen=True)
class _Grown(PeerConfig):
    """PeerConfig after another helper added fields: one line each, nothing else."""

    relay: bool = True
    relay_max_bytes: int = 1 << 20
    relay_slots: int = 4


def test_a_new_field_is_settable_three_ways_without_more_code(monkeypatch, tmp_path):
    from peer import settings

    monkeypatch.setattr(settings, "SETTINGS_CLASSES", (_Grown, ServeOptions))
    args = cli.build_parser().parse_args(
        ["serve", "--no-relay", "--relay-max-bytes", "2MiB", "--config", "none"]
    )
    config = cli.config_from_args(args)
    assert isinstance(config, _Grown)
    assert (config.relay, config.relay_max_bytes, config.relay_slots) == (False, 2 << 20, 4)
    monkeypatch.setenv("PREFIXSWARM_RELAY_SLOTS", "9")
    file = tmp_path / "c.toml"
    file.write_text("relay = false\n")
    config, _ = load_settings(config_file=file)
    assert isinstance(config, _Grown)
    assert (config.relay, config.relay_slots) == (False, 9)


def test_print_config_round_trips_through_a_config_file(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSWARM_POLICY", "longest_prefix")
    argv = ["serve", "--config", "none", "--cache-bytes", "2GiB", "--bootstrap", BOOT, BOOT2,
            "--identity", "none", "--served-model-name", "smol", "--print-config"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert 'policy = "longest_prefix"' in text and "cache_bytes = 2147483648" in text
    assert 'identity_file = "none"' in text
    file = tmp_path / "printed.toml"
    file.write_text(text)
    monkeypatch.delenv("PREFIXSWARM_POLICY")
    printed = load_settings(config_file=file)
    expected = cli.settings_from_args(cli.build_parser().parse_args(argv[:-1]))
    assert printed == (
        dataclasses.replace(expected[0], policy=Policy.LONGEST_PREFIX), expected[1]
    )
