"""Checkpoints in memory, mirrored to a peer (``checkpoint.memory_interval``): one rank's side.

Every N steps a rank copies its shard of the training state (the tensors a disk checkpoint's
shards hold, plus the train state and its RNG) to host memory -- the only time training waits --
and a background thread sends it to its host's keeper (memory_keeper.py) and to the keeper of the
next host (a peer on another machine). On a restart every rank lists what the keepers hold; the
newest step every rank can fetch (its own shard, from its own host or a peer's mirror; under plain
data parallelism any rank's shard, each holding the whole state) and no older than the disk
checkpoint is loaded, after every rank checked its shard against the tensors it holds. Anything
short of that -- a missing shard, a keeper gone, garbage, a wrong size -- falls back to disk.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge.checkpoint.memory_frame import MAX_HEADER, MemoryShardError
from meshforge.checkpoint.memory_keeper import MAX_SHARD, ensure_keeper, live_port, request, shared_secret
from meshforge.checkpoint.memory_wire import decode, encode
from meshforge.errors import ConfigError
from meshforge.launch import env as launch_env
from meshforge.safeio.links import make_dir

HOST_ENV = "MESHFORGE_HOST"
_HOST = re.compile(r"^[A-Za-z0-9.:-]{1,64}$")
Keeper = tuple[str, int]


def host_address() -> str:
    """This host's address as its peers reach it: ``MESHFORGE_HOST``, else the address this machine
    reaches the job's master from (no packet is sent)."""
    if v := os.environ.get(HOST_ENV):
        if not _HOST.match(v):
            raise ConfigError(f"{HOST_ENV}={v[:80]!r} is not a host address; give this host's IP address or name")
        return v
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state tree by dotted key: a DTensor's local shard, as is (no copy)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if not isinstance(tree, torch.Tensor):
        raise MemoryShardError(f"{prefix[:-1]} is a {type(tree).__name__}: memory checkpoints hold tensors only")
    local = tree.to_local() if hasattr(tree, "to_local") else tree
    return {prefix[:-1]: local.detach()}


class Found:
    """A rank's shard fetched for a restore: its step, tensors, train info, and which keeper served it."""

    def __init__(self, step: int, header: dict[str, Any], tensors: dict[str, torch.Tensor], host: str, own: bool):
        self.step, self.info, self.tensors, self.host, self.own = step, header.get("info"), tensors, host, own
        self.hosts: list[str] = []  # every rank's serving host (filled in on every rank)
        self.peers: list[int] = []  # the ranks served by another host's keeper


class MemoryTier:
    """One rank's memory checkpoints: its keeper, its peer, the sends in flight, restores."""

    def __init__(self, run_dir: Path, rank: int, layout: dict[str, Any], interval: int):
        self.rank, self.layout, self.interval = rank, layout, interval
        self.dir = make_dir(Path(run_dir) / "memory")
        self.host = host_address()
        self.token = shared_secret(self.dir)
        port = ensure_keeper(self.dir, self.host, self.token, spawn=launch_env.local_rank() == 0)
        everyone: list[Any] = [None] * max(1, dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(everyone, (self.host, port))
        else:
            everyone = [(self.host, port)]
        self.rank_hosts = [h for h, _ in everyone]
        hosts = sorted({tuple(k) for k in everyone})
        me = (self.host, port)
        peer = hosts[(hosts.index(me) + 1) % len(hosts)] if len(hosts) > 1 else None
        self.targets: list[Keeper] = [me] + ([peer] if peer else [])
        self.thread: threading.Thread | None = None
        self.failures: list[str] = []
        self.held_any = False  # (find: whether any keeper held a shard some rank could load)

    def keepers(self) -> list[Keeper]:
        """Every keeper this run's registry names that answers (own host first)."""
        out = [self.targets[0]]
        for f in sorted(self.dir.glob("keeper-*.json")):
            host = f.name[len("keeper-") : -len(".json")]
            if host != self.host and _HOST.match(host) and (port := live_port(self.dir, host, self.token)):
                out.append((host, port))
        return out

    def snapshot(self, step: int, tree: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
        """Copy this rank's state to host memory now and send it in the background; the event's fields."""
        self.wait()
        t0 = time.perf_counter()
        flat = {k: v.to("cpu", copy=True).contiguous() for k, v in flatten(tree).items()}
        blocking = time.perf_counter() - t0
        entries, parts, size = encode(flat)
        shard = {"rank": self.rank, "step": step, "layout": self.layout, "info": info, "tensors": entries}
        head = {"op": "put", "rank": self.rank, "step": step, "shard": shard, "size": size}
        self.thread = threading.Thread(target=self._send, args=(head, parts), daemon=True)  # (parts hold the copies)
        self.thread.start()
        return {"step": step, "bytes": size, "blocking_s": round(blocking, 4), "hosts": [h for h, _ in self.targets]}

    def _send(self, head: dict[str, Any], parts: list) -> None:
        for host, port in self.targets:
            try:
                request(host, port, self.token, head, parts)
            except MemoryShardError as e:
                self.failures.append(str(e))

    def wait(self) -> None:
        """Until the last snapshot's sends are done."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _candidates(self) -> dict[int, list[tuple[Keeper, int, bool]]]:
        """By step: (keeper, rank, own) of each shard this rank could load, best first."""
        out: dict[int, list[tuple[Keeper, int, bool]]] = {}
        for k in self.keepers():
            try:
                held = request(*k, self.token, {"op": "list"}, timeout=5)[0].get("shards")
            except MemoryShardError:
                continue
            for r, s, lay in held if isinstance(held, list) else []:
                if not (type(r) is int and type(s) is int and isinstance(lay, dict)):
                    continue
                own = r == self.rank and lay == self.layout
                if own or (lay.get("replicated") and self.layout.get("replicated")):
                    out.setdefault(s, []).append((k, r, own))
        for c in out.values():
            c.sort(key=lambda x: (not x[2], x[0] != self.targets[0]))
        return out

    def _fetch(self, step: int, cands: list[tuple[Keeper, int, bool]]) -> Found:
        """This rank's shard at ``step`` from the first keeper that gives a well-formed one."""
        errors = []
        for (host, port), r, own in cands:
            try:
                ask = {"op": "get", "rank": r, "step": step}
                h, payload = request(host, port, self.token, ask, max_payload=MAX_SHARD)
                shard = h.get("shard")
                if not isinstance(shard, dict) or shard.get("step") != step or shard.get("rank") != r:
                    raise MemoryShardError(f"the memory keeper at {host}:{port} answered another shard than asked")
                if not isinstance(shard.get("info"), dict) or len(str(shard["info"])) > MAX_HEADER:
                    raise MemoryShardError(f"the memory keeper at {host}:{port} sent a shard without its train state")
                tensors = decode(shard.get("tensors"), payload, f"rank {r}'s step-{step} shard from {host}")
                return Found(step, shard, tensors, host, own)
            except MemoryShardError as e:
                errors.append(str(e))
        raise MemoryShardError("; ".join(errors) or f"no keeper holds a shard for rank {self.rank} at step {step}")

    def find(self, disk_step: int | None) -> tuple[Found | None, str]:
        """The newest memory checkpoint every rank fetched (a collective), or None and why not."""
        cands = self._candidates()
        steps = {s for s in cands if disk_step is None or s >= disk_step}
        every = gather(steps)
        self.held_any = any(every)
        common = set.intersection(*every) if every else set()
        if not common:
            missing = sorted(r for r, s in enumerate(every) if not s)
            return None, (f"ranks {missing} have no shard in memory" if missing else "no step has every shard")
        step = max(common)
        try:
            found, err = self._fetch(step, cands[step]), None
        except MemoryShardError as e:
            found, err = None, str(e)
        said = gather((err, found.host if found else None, found.own if found else None))
        errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(said) if e]
        if errors:
            return None, "; ".join(errors)[:2000]
        found.hosts = [h for _, h, _ in said]
        found.peers = [r for r, (_, h, _) in enumerate(said) if h != self.rank_hosts[r]]
        return found, ""

    def trim(self, step: int) -> None:
        """Drop what the keepers hold past ``step`` (a failed attempt's shards: never to mix with this one's)."""
        for k in self.keepers():
            try:
                request(*k, self.token, {"op": "trim", "rank": -1, "step": step}, timeout=5)
            except MemoryShardError:
                pass


def gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
