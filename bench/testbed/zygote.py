"""A fork server for peer processes: pays the heavy imports (torch, transformers, libp2p,
peer.cli: 5.6 s of CPU, 28 s under a 0.2-core quota) once, then forks each peer from it.

    python -m bench.testbed.zygote          (stdin/stdout: one JSON object per line)
    first line out: {"ready": true, "pid": N, "import_s": 5.1, "threads": 1}
    {"op": "spawn", "argv": ["serve", ...], "stdout": PATH, "stderr": PATH,
     "netns": NAME (optional)}                        -> {"pid": N}
    {"op": "reap"}  -> {"exited": [{"pid": N, "code": C}, ...]}   (C < 0: killed by -C)
    anything else   -> {"error": "..."}

A child starts a new session, reads /dev/null, writes its stdout/stderr to the files
(appending), enters network namespace NAME when given (else it stays in the zygote's:
start the zygote under `ip netns exec`), runs peer.cli.main(argv) with the default signal
dispositions (so SIGTERM drains a serving peer as in a normal start) and exits with its
code. The zygote starts no thread and no event loop before it forks (`threads` in the
ready line is the count it checked). When stdin closes it sends SIGTERM to the children
still running, SIGKILL after STOP_GRACE_S, reaps them and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import pkgutil
import signal
import sys
import time
import traceback
from typing import Any

STOP_GRACE_S = 15.0  # a peer's drain is bounded by its --drain-timeout; this is the cap
CLONE_NEWNET = 0x40000000


PRELOAD = (  # what `serve` imports on its way up (most of it lazily, after parsing argv)
    "torch", "transformers", "transformers.models.llama.modeling_llama", "peer.cli",
    "peer.preflight", "peer.engine.engine", "peer.progress", "peer.net.host", "peer.node",
    "peer.api.http",
)


CODE_PACKAGES = ("peer", "protocols")  # imported whole, so no child reads code from disk


def preload() -> None:
    """The heavy imports, then every module of the project's packages: a child must not
    import a module lazily from disk after the fork, or a file edited while a testbed
    runs would put new code into the peers of its later runs (it did once)."""
    for name in PRELOAD:
        importlib.import_module(name)
    for package_name in CODE_PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.walk_packages(package.__path__, f"{package_name}."):
            importlib.import_module(module.name)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _child(argv: list[str], stdout: str, stderr: str, netns: str | None) -> None:
    """The forked child: never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, stdout), (2, stderr)):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (lives as long as the process)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        if netns:
            _enter_netns(netns)
        import peer.cli

        code = peer.cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a forked child must never return into the zygote's loop:
        traceback.print_exc()  # whatever ended it is printed, and it exits 1
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


class Zygote:
    """The children spawned and not yet reaped."""

    def __init__(self) -> None:
        self.children: set[int] = set()

    def spawn(self, argv: list[str], stdout: str, stderr: str, netns: str | None) -> int:
        if not all(isinstance(a, str) for a in argv):
            raise TypeError("argv must be a list of strings")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, stdout, stderr, netns)
        self.children.add(pid)
        return pid

    def reap(self) -> list[dict[str, int]]:
        exited = []
        for pid in list(self.children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.children.discard(pid)
                exited.append({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
        return exited

    def stop(self) -> None:
        """SIGTERM every child, SIGKILL what is left after STOP_GRACE_S, reap all."""
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self.children):
            os.waitpid(pid, 0)
        self.children.clear()

    def answer(self, line: str) -> dict[str, Any]:
        try:
            request = json.loads(line)
            op = request["op"]
            if op == "spawn":
                pid = self.spawn(list(request["argv"]), str(request["stdout"]),
                                 str(request["stderr"]), request.get("netns"))
                return {"pid": pid}
            if op == "reap":
                return {"exited": self.reap()}
            return {"error": f"unknown op {op!r}"}
        except (ValueError, KeyError, TypeError, OSError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    started = time.monotonic()
    preload()
    zygote = Zygote()
    _say({"ready": True, "pid": os.getpid(), "import_s": round(time.monotonic() - started, 2),
          "threads": _threads()})
    try:
        for line in sys.stdin:
            if line.strip():
                _say(zygote.answer(line))
    finally:
        zygote.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
