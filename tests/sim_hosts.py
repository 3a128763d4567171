"""Simulated hosts for tests: scripts/sim_hosts.sh's network namespaces, or (where namespaces
are not permitted: no root, no CAP_NET_ADMIN, no iproute2; or MESHFORGE_SIM_HOSTS=loopback)
distinct loopback addresses. A SIGTERM (a timeout's kill) still removes the namespaces.

    with SimHosts(2) as hosts:
        p = hosts.popen(0, ["torchrun", ...])   # runs "on" host 0 (its netns, its address)
        hosts.kill(1)                           # every process of host 1 gets SIGKILL
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import IO, Any

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sim_hosts.sh"
NET = "10.77.0"


def _namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.environ.get("MESHFORGE_SIM_HOSTS") == "loopback":
        return "MESHFORGE_SIM_HOSTS=loopback asks for loopback addresses"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "not root (ip netns needs CAP_NET_ADMIN)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(k) for k in out]
    return [d for k in kids for d in _descendants(k)] + kids


class SimHosts:
    """``n`` hosts with their own addresses; ``fallback`` says why loopback addresses stand in."""

    def __init__(self, n: int, netem: str = "") -> None:
        self.n, self.netem = n, netem
        self.name = "mf" + secrets.token_hex(3)  # unique per run: concurrent tests never share a namespace
        self.fallback: str | None = None
        self.notes = ""
        self._procs: dict[int, list[subprocess.Popen]] = {i: [] for i in range(n)}
        self._old_term: Any = None

    def __enter__(self) -> SimHosts:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # let __exit__ run when we are terminated
            self._old_term = signal.signal(signal.SIGTERM, _terminated)
        why = _namespaces_unavailable()
        if why is None:
            r = subprocess.run(
                [str(SCRIPT), "up", self.name, str(self.n), *self.netem.split()], capture_output=True, text=True
            )
            self.notes = r.stderr.strip()
            if r.returncode != 0:
                why = f"`sim_hosts.sh up` failed: {r.stderr.strip()[-300:]}"
        if why is not None:
            self.fallback = f"network namespaces unavailable ({why}); hosts are loopback addresses 127.0.0.2.."
        return self

    def __exit__(self, *exc: object) -> None:
        for i in range(self.n):
            self.kill(i)
        if self.fallback is None:
            subprocess.run([str(SCRIPT), "down", self.name], capture_output=True)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)

    def addr(self, i: int) -> str:
        return f"127.0.0.{i + 2}" if self.fallback else f"{NET}.{i + 1}"

    def ifname(self, i: int) -> str:
        """The interface gloo / NCCL should use on host ``i`` (GLOO_SOCKET_IFNAME)."""
        return "lo" if self.fallback else "eth0"

    def popen(
        self, i: int, cmd: list[str], env: dict[str, str] | None = None, out: IO | None = None
    ) -> subprocess.Popen:
        """Start ``cmd`` on host ``i`` (in its own session, so that ``kill`` finds all of it)."""
        full = cmd if self.fallback else ["ip", "netns", "exec", f"{self.name}-h{i}", *cmd]
        e = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.ifname(i)}
        p = subprocess.Popen(full, env=e, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        self._procs[i].append(p)
        return p

    def kill(self, i: int) -> None:
        """SIGKILL everything running on host ``i``: the host dies."""
        if self.fallback is None:
            subprocess.run([str(SCRIPT), "kill", self.name, str(i)], capture_output=True)
        for p in self._procs[i]:
            for pid in [*_descendants(p.pid), p.pid]:  # torchrun starts its workers in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        self._procs[i] = []
