"""Checks `serve` runs before loading the model, so a misconfiguration is one line at once.

    check_serve(config, options)            # ConfigError naming the first problem
    check_peer(config)                      # its addresses and ports only (embedding)
    with hold_identity(config.identity_file):  # ConfigError if another peer holds it
        ...run the peer...

Ports are tested by binding them ourselves WITHOUT SO_REUSEPORT: py-libp2p listens with
it, so a second peer on the same port would otherwise start and silently share it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from peer.config import PeerConfig
from peer.settings import ConfigError, ServeOptions, is_loopback_host, split_host_port

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"  # identity.key -> identity.key.lock, held while the peer runs


def _multiaddr(addr: str, what: str) -> object:
    import multiaddr

    try:
        return multiaddr.Multiaddr(addr)
    except Exception as exc:  # multiaddr raises a zoo of types for bad input
        raise ConfigError(f"{what} {addr!r} is not a valid multiaddr ({exc})") from None


def _is_peer_id(text: str) -> bool:
    """A base58 multihash (identity 0x00 or sha2-256 0x12) with a matching length byte."""
    import base58

    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    return len(raw) > 2 and raw[0] in (0x00, 0x12) and raw[1] == len(raw) - 2


def check_multiaddrs(config: PeerConfig) -> None:
    """Every address parses; every bootstrap address ends in a valid /p2p/<peer id>."""
    for addr in config.listen_addrs:
        _multiaddr(addr, "listen address")
    for addr in config.announce_addrs:
        _multiaddr(addr, "announce address")
    for addr in config.bootstrap:
        peer_id = addr.rsplit("/p2p/", 1)[1].split("/", 1)[0]
        if not _is_peer_id(peer_id):
            raise ConfigError(
                f"bootstrap address {addr!r}: {peer_id!r} after /p2p/ is not a peer id "
                "(copy the whole address the other peer printed)"
            ) from None
        _multiaddr(addr, "bootstrap address")


def _check_bind(family: socket.AddressFamily, host: str, port: int, what: str, hint: str) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{what}: port {port} is already in use; {hint}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{what}: {host} is not an address of this machine") from None
            raise ConfigError(f"{what}: cannot bind {host}:{port}: {exc.strerror}") from None


def check_listen_ports(config: PeerConfig) -> None:
    """TCP listen addresses with a fixed port must be free."""
    for addr in config.listen_addrs:
        parts = addr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
            continue
        if not parts[3].isdigit() or int(parts[3]) == 0:
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        hint = "is another peer running? Choose another with --listen /ip4/0.0.0.0/tcp/PORT"
        _check_bind(family, parts[1], int(parts[3]), f"listen address {addr}", hint)


def check_http(address: str, *, api_key: str | None = None, insecure: bool = False) -> None:
    """HOST:PORT parses, HOST resolves, a fixed PORT is free, and an address beyond
    loopback has an API key (unless `insecure`: the operator said so, and one warning
    line says what that means)."""
    try:
        host, port = split_host_port(address)
    except ValueError as exc:
        raise ConfigError(f"--http: {exc}") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--http {address}: cannot resolve {host!r} ({exc.strerror})") from None
    beyond = sorted({str(i[4][0]) for i in infos if not is_loopback_host(str(i[4][0]))})
    if beyond and api_key is None and not insecure:
        raise ConfigError(
            f"--http {address} serves beyond this machine ({', '.join(beyond)}) without an "
            "API key: anyone who reaches it could use this peer; set PREFIXSWARM_API_KEY "
            "(or --api-key), or say --insecure-no-api-key"
        )
    if beyond and api_key is None:
        logger.warning(
            "--http %s serves beyond this machine (%s) without an API key "
            "(--insecure-no-api-key): anyone who reaches it can use this peer",
            address, ", ".join(beyond),
        )
    if port == 0:
        return
    family, _, _, _, sockaddr = infos[0]
    hint = "is another peer's HTTP API there? Choose another with --http HOST:PORT"
    _check_bind(family, str(sockaddr[0]), port, f"--http {address}", hint)


def check_model(name: str) -> None:
    from peer.engine.api import ModelLoadError
    from peer.engine.model import check_model_name

    try:
        check_model_name(name)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None


def check_peer(config: PeerConfig) -> None:
    """The peer's own addresses parse and its fixed listen ports are free; ConfigError
    otherwise (`serve` and the embedding facade, prefixswarm.open_peer, both run it)."""
    check_multiaddrs(config)
    check_listen_ports(config)


def check_serve(config: PeerConfig, options: ServeOptions) -> None:
    """Everything `serve` can check without loading the model; ConfigError otherwise."""
    check_peer(config)
    if options.http:
        check_http(options.http, api_key=options.api_key, insecure=options.insecure_no_api_key)
    check_model(config.model)


@contextmanager
def hold_identity(identity_file: Path | None) -> Iterator[None]:
    """Hold `<identity>.lock` while the peer runs: one identity, one running peer."""
    if identity_file is None:
        yield
        return
    lock_path = Path(os.path.expanduser(identity_file)).with_name(
        Path(identity_file).name + LOCK_SUFFIX
    )
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create the identity lock {lock_path}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(
                f"identity {identity_file} is in use by a running peer (pid {holder}); "
                "give this one its own with --identity PATH (or --identity none)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
