"""A host's memory keeper: the process that holds the memory checkpoints of the ranks on its host (and
the mirrors its peers send it) while those ranks are killed and restarted.

An elastic restart kills every worker, so the copies must live outside them: the first rank of a
host starts one keeper per host (``python -m meshforge.checkpoint.memory_keeper``, a session of its
own, so torchrun's kill of its workers' process groups passes it by), and it lives as long as the
launcher it watches (torchrun's agent, or ``meshforge train --nproc N``): the host's death is its
death. It listens on the host's address and names its port in ``run.dir/memory/keeper-HOST.json``;
every request must carry the run's token (``run.dir/memory/secret``, random, readable by its owner
only), checked before a byte of payload is read. It keeps the newest two steps of each rank.
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from meshforge.checkpoint.memory_frame import MemoryShardError, recv_msg, send_msg
from meshforge.launch.tie import alive
from meshforge.safeio.files import read_regular
from meshforge.safeio.links import open_append, write_new
from meshforge.safeio.parse import read_json

KEEP_STEPS = 2
MAX_SHARD = 1 << 40


def registry(mem_dir: Path, host: str) -> Path:
    """Where the keeper of ``host`` names its port."""
    return Path(mem_dir) / f"keeper-{host}.json"


def shared_secret(mem_dir: Path) -> str:
    """The run's token: made once (a link of a complete file: no reader sees half of it), then read."""
    path = Path(mem_dir) / "secret"
    if not path.exists():
        tmp = Path(mem_dir) / f".secret-{os.getpid()}-{secrets.token_hex(4)}"
        write_new(tmp, secrets.token_hex(32))
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    token = read_regular(path, 256, MemoryShardError).decode("ascii", "replace").strip()
    if len(token) != 64 or any(c not in "0123456789abcdef" for c in token):
        raise MemoryShardError(f"{path} is not a memory keeper token (64 hex digits); remove it, a run makes another")
    return token


class Keeper:
    """The shards held, by rank and step, and the answer to each request."""

    def __init__(self, host: str, token: str):
        self.host, self.token = host, token
        self.shards: dict[int, dict[int, tuple[dict[str, Any], bytearray]]] = {}
        self.lock = threading.Lock()

    def accept(self, header: dict[str, Any]) -> None:
        if not hmac.compare_digest(str(header.get("token", "")), self.token):
            raise MemoryShardError("a request without this run's token (another run, or not meshforge)")

    def answer(self, h: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], list[bytes | memoryview]]:
        op, rank, step = h.get("op"), h.get("rank"), h.get("step")
        if op == "ping":
            return {"ok": True, "host": self.host}, []
        if op == "list":
            with self.lock:
                held = [[r, s, d[0].get("layout")] for r, steps in self.shards.items() for s, d in steps.items()]
            return {"ok": True, "host": self.host, "shards": held}, []
        if type(rank) is not int or type(step) is not int:
            return {"ok": False, "error": f"{op!r} needs an integer rank and step"}, []
        if op == "put" and isinstance(h.get("shard"), dict):
            with self.lock:
                steps = self.shards.setdefault(rank, {})
                steps[step] = (h["shard"], payload)
                for old in sorted(steps)[:-KEEP_STEPS]:
                    del steps[old]
            return {"ok": True, "host": self.host}, []
        if op == "trim":
            with self.lock:
                for r, steps in self.shards.items():
                    for old in [s for s in steps if s > step and rank in (-1, r)]:
                        del steps[old]
            return {"ok": True, "host": self.host}, []
        if op == "get":
            with self.lock:
                got = self.shards.get(rank, {}).get(step)
            if got is None:
                return {"ok": False, "error": f"no shard of rank {rank} at step {step}"}, []
            return {"ok": True, "host": self.host, "shard": got[0], "size": len(got[1])}, [memoryview(got[1])]
        return {"ok": False, "error": f"unknown request {op!r}"}, []

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                h, payload = recv_msg(conn, "a client", MAX_SHARD, self.accept)
                reply, parts = self.answer(h, payload)
            except (MemoryShardError, OSError) as e:
                reply, parts = {"ok": False, "error": str(e)[:300]}, []
            try:
                send_msg(conn, reply, parts)
            except OSError:
                pass


def serve(mem_dir: Path, host: str, watch: int) -> None:
    """Listen on ``host`` until the process ``watch`` is gone; the registry names the port."""
    keeper = Keeper(host, shared_secret(mem_dir))
    server = socket.create_server((host, 0))
    port = server.getsockname()[1]
    tmp = registry(mem_dir, host).with_suffix(f".tmp{os.getpid()}")
    write_new(tmp, f'{{"host": "{host}", "port": {port}, "pid": {os.getpid()}}}')
    os.replace(tmp, registry(mem_dir, host))

    def accept_loop() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=keeper.serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    while alive(watch):
        time.sleep(0.5)
    os._exit(0)


def request(
    host: str,
    port: int,
    token: str,
    header: dict[str, Any],
    parts: list = (),
    max_payload: int = 0,
    timeout: float = 30.0,
) -> tuple[dict[str, Any], bytearray]:
    """One request to the keeper at ``host:port``; its refusal or silence is a MemoryShardError."""
    where = f"the memory keeper at {host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            send_msg(s, {**header, "token": token}, parts)
            h, payload = recv_msg(s, where, max_payload)
    except OSError as e:
        raise MemoryShardError(f"{where} cannot be reached ({e})") from None
    if h.get("ok") is not True:
        raise MemoryShardError(f"{where} refused: {str(h.get('error'))[:300]}")
    return h, payload


def live_port(mem_dir: Path, host: str, token: str) -> int | None:
    """The port of ``host``'s keeper when the registry names one that answers, else None."""
    try:
        port = read_json(registry(mem_dir, host), MemoryShardError).get("port")
        if type(port) is not int:
            return None
        request(host, port, token, {"op": "ping"}, timeout=2)
        return port
    except (MemoryShardError, AttributeError, OSError):
        return None


def ensure_keeper(mem_dir: Path, host: str, token: str, spawn: bool, timeout: float = 60) -> int:
    """The port of this host's keeper; ``spawn``: start it if none answers (a host's first rank does)."""
    deadline, started = time.monotonic() + timeout, False
    while (port := live_port(mem_dir, host, token)) is None:
        if spawn and not started:
            log = open_append(Path(mem_dir) / f"keeper-{host}.log")
            cmd = [sys.executable, "-m", "meshforge.checkpoint.memory_keeper", str(mem_dir), host, str(os.getppid())]
            out = {"stdout": log, "stderr": subprocess.STDOUT}
            subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, **out)
            log.close()
            started = True
        if time.monotonic() > deadline:
            raise MemoryShardError(
                f"no memory keeper answered on {host} within {timeout:g} s (see {mem_dir}/keeper-{host}.log); "
                "set checkpoint.memory_interval = 0 to train without memory checkpoints"
            )
        time.sleep(0.1)
    return port


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="a host's memory keeper (started by meshforge's ranks)")
    ap.add_argument("dir")
    ap.add_argument("host")
    ap.add_argument("watch", type=int)
    a = ap.parse_args(argv)
    serve(Path(a.dir), a.host, a.watch)


if __name__ == "__main__":
    main()
