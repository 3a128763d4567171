"""The lighthouse: torchft's quorum server for the replica groups (``meshforge lighthouse``), and the
pre-flight's look at it (a TCP connect: no quorum request, so the groups' quorums are not disturbed)."""

from __future__ import annotations

import os
import signal
import socket
import time
from urllib.parse import urlsplit

from meshforge.errors import ConfigError

# How fast a dead group is left behind: the lighthouse drops a group whose manager sent no heartbeat
# (every 100 ms) for this long, and a quorum that changes members waits at most JOIN_TIMEOUT_MS
# for groups that heartbeat but have not asked yet.
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 1000


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether something listens at the lighthouse URL's host and port."""
    u = urlsplit(url)
    try:
        with socket.create_connection((u.hostname or "", u.port or 80), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def check_reachable(url: str) -> None:
    """Refuse a fault-tolerant run whose lighthouse does not answer (before anything is written)."""
    if not reachable(url):
        raise ConfigError(
            f"fault_tolerance.lighthouse = {url} does not answer (nothing listens there); start it first with "
            f"`meshforge lighthouse --bind HOST:PORT --min-replicas N` on a machine every group reaches, or fix the URL"
        )


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::]:PORT`` for every address) as (host, port); ConfigError names the form."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--bind {bind!r}: expected HOST:PORT, e.g. 0.0.0.0:29510 or [::]:29510")
    return host.strip("[]") if host.startswith("[") else host, int(port)


def serve(
    bind: str, min_replicas: int, heartbeat_ms: int = HEARTBEAT_TIMEOUT_MS, join_ms: int = JOIN_TIMEOUT_MS
) -> int:
    """Run torchft's lighthouse in the foreground until Ctrl-C / SIGTERM; returns the exit code."""
    host, port = parse_bind(bind)
    os.environ.setdefault("RUST_LOG", "warn")  # (its servers log every quorum at info)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise ConfigError("meshforge lighthouse needs torchft: pip install 'meshforge[ft]'") from None
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server = LighthouseServer(
            bind=listen, min_replicas=min_replicas, join_timeout_ms=join_ms, heartbeat_timeout_ms=heartbeat_ms
        )
    except Exception as e:  # noqa: BLE001 - the Rust server raises a plain RuntimeError
        raise ConfigError(f"--bind {bind}: the lighthouse cannot listen there ({e}); pick a free port") from None
    print(f"meshforge lighthouse: listening on http://{host if host not in ('0.0.0.0', '::') else socket.gethostname()}"
          f":{port} (min {min_replicas} replica group(s)); Ctrl-C stops it", flush=True)  # fmt: skip
    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
