"""Checkpoints in memory, mirrored to a peer (checkpoint.memory_interval): two ranks on two simulated
hosts (tests/sim_hosts.py), each under its own torchrun agent, restarted by the agents. A restart
from memory continues bit-identically (fp32, CPU, gloo); a host that died takes its keeper with it
and its rank's shard comes from the peer's mirror; a missing or wrong-sized shard falls back to disk."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_args, tiny_overrides
from sim_hosts import SimHosts, free_port

STEPS = 16
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            pass
    return out


def _events(d: Path, name: str) -> list[dict]:
    return [e for e in _jsonl(d / "events.jsonl") if e["event"] == name]


def _args(d: Path, corpus: Path, **extra) -> list[str]:
    o = {"train.steps": STEPS, "train.eval_batches": 0, "train.device": "cpu", "checkpoint.memory_interval": 2}
    return cli_args(tiny_overrides(d, corpus, **{**o, **extra}))


class TwoHosts:
    """Two torchrun agents (one rank each) on two simulated hosts; host 0 keeps the rendezvous."""

    def __init__(self, hosts: SimHosts, tmp: Path, args: list[str], env: dict[str, str]):
        self.hosts, self.tmp, self.args, self.env = hosts, tmp, args, env
        self.port = free_port() if hosts.fallback else 29460
        self.procs: dict[int, object] = {}
        self.logs: list[Path] = []

    def start(self, i: int) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--max-restarts=3",
            "--monitor-interval=0.5", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.hosts.addr(0)}:{self.port}",
            f"--rdzv-id={self.hosts.name}", f"--rdzv-conf=is_host={int(i == 0)},{RDZV_CONF}",
            f"--local-addr={self.hosts.addr(i)}", "-m", "meshforge", "train", *self.args,
        ]  # fmt: skip
        log = self.tmp / f"host{i}-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("w") as f:
            self.procs[i] = self.hosts.popen(i, cmd, {**ENV, **self.env, "MESHFORGE_HOST": self.hosts.addr(i)}, f)

    def wait(self, what: str, cond, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in self.procs.values()):
                tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs if p.exists())
                pytest.fail(f"waiting for {what}: timed out or an agent failed\n{tails}")
            time.sleep(0.2)

    def finish(self) -> None:
        self.wait("the run's end", lambda: all(p.poll() is not None for p in self.procs.values()))


def _run(tmp: Path, corpus: Path, name: str, fault: str = "", kill_host=None, **extra) -> Path:
    """One run on two hosts; ``kill_host(hosts, run_dir)``: kill host 1 once a memory checkpoint and a
    disk one exist, call it, and start host 1 again."""
    d = tmp / name
    env = {"MESHFORGE_FAULT": fault} if fault else {}
    with SimHosts(2) as hosts:
        two = TwoHosts(hosts, tmp, _args(d, corpus, **extra), env)
        two.start(0)
        two.start(1)
        if kill_host is not None:
            disk = bool(extra.get("checkpoint.interval"))
            ready = lambda: len(_events(d, "memory_checkpoint")) >= 3 and (_events(d, "checkpoint_saved") or not disk)  # noqa: E731
            two.wait("memory checkpoints (and a disk one)", ready)
            hosts.kill(1)
            kill_host(hosts, d)
            two.start(1)
        two.finish()
        assert all(p.returncode == 0 for p in two.procs.values()), two.logs[-1].read_text()[-3000:]
    return d


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    return _run(tmp_path_factory.mktemp("memref"), corpus, "ref")


def _losses(d: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in _jsonl(d / "metrics.jsonl")}


def test_a_restart_from_memory_continues_bit_identically(tmp_path, corpus, reference):
    d = _run(tmp_path, corpus, "run", fault="kill:rank=1:step=7", **{"checkpoint.interval": 0})
    resumed = _events(d, "resumed")
    assert [(e["source"], e["step"]) for e in resumed] == [("memory", 6)], resumed
    assert resumed[0]["from_peer"] == [] and len(set(resumed[0]["hosts"])) == 2
    got, ref = _losses(d), _losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # every step's loss and grad norm, bit for bit
    assert (d / "final" / "model.safetensors").read_bytes() == (reference / "final" / "model.safetensors").read_bytes()


def test_a_dead_hosts_shard_comes_from_its_peers_mirror(tmp_path, corpus, reference):
    d = _run(tmp_path, corpus, "run", fault="pace:ms=300", kill_host=lambda hosts, d: None)
    resumed = _events(d, "resumed")[-1]
    assert resumed["source"] == "memory", resumed
    assert len(resumed["from_peer"]) == 1  # the rank on the host that died: its own keeper died with it
    assert set(resumed["hosts"]) == {resumed["hosts"][0]}  # both shards from the surviving host's keeper
    got, ref = _losses(d), _losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([ref[s] for s in sorted(ref)], rel=1e-6)


def _host1_rank(hosts: SimHosts, d: Path) -> int:
    first = _events(d, "memory_checkpoint")[0]  # rank 0's: its own host first, then its peer's
    return 0 if first["hosts"][0] == hosts.addr(1) else 1


# run on host 0 (its namespace: the simulated hosts' addresses are reachable only there): talk to its keeper
ON_HOST0 = """
import json, sys
from pathlib import Path
from meshforge.checkpoint.memory_keeper import registry, request, shared_secret
mem, host, what, arg = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
port, token = json.loads(registry(mem, host).read_text())["port"], shared_secret(mem)
if what == "forget":  # every shard of rank ``arg``
    request(host, port, token, {"op": "trim", "rank": arg, "step": 0})
else:  # plant, per rank, a copy of its newest shard as a newer step, its first tensor declared 3 floats long
    held = request(host, port, token, {"op": "list"})[0]["shards"]
    for rank in (0, 1):
        step = max(s for r, s, _ in held if r == rank)
        got, payload = request(host, port, token, {"op": "get", "rank": rank, "step": step}, max_payload=1 << 30)
        shard = {**got["shard"], "step": arg}
        shard["tensors"][0] = {**shard["tensors"][0], "shape": [3], "nbytes": 12}
        head = {"op": "put", "rank": rank, "step": arg, "shard": shard, "size": len(payload)}
        request(host, port, token, head, [bytes(payload)])
"""


def _on_host0(hosts: SimHosts, d: Path, what: str, arg: int) -> None:
    p = hosts.popen(0, [sys.executable, "-c", ON_HOST0, str(d / "memory"), hosts.addr(0), what, str(arg)])
    assert p.wait(120) == 0


def test_a_missing_shard_falls_back_to_disk(tmp_path, corpus):
    def drop_mirror(hosts: SimHosts, d: Path) -> None:  # host 1's keeper died; the survivor forgets its mirror
        _on_host0(hosts, d, "forget", _host1_rank(hosts, d))

    extra = {"parallel.zero_stage": 3, "checkpoint.interval": 4}  # FSDP: each rank's shard is its own
    d = _run(tmp_path, corpus, "run", fault="pace:ms=300", kill_host=drop_mirror, **extra)
    unused = _events(d, "memory_checkpoint_unused")
    assert unused and "no shard in memory" in unused[-1]["reason"], unused
    assert _events(d, "resumed")[-1]["source"] == "disk"
    assert sorted(_losses(d)) == list(range(1, STEPS + 1))


def test_a_shard_of_the_wrong_size_is_refused_and_disk_used(tmp_path, corpus):
    def plant(hosts: SimHosts, d: Path) -> None:
        _on_host0(hosts, d, "plant", 10**6)

    d = _run(tmp_path, corpus, "run", fault="pace:ms=300", kill_host=plant, **{"checkpoint.interval": 4})
    unused = _events(d, "memory_checkpoint_unused")
    assert unused and "this rank holds" in unused[-1]["reason"], unused
    assert _events(d, "resumed")[-1]["source"] == "disk"
    assert sorted(_losses(d)) == list(range(1, STEPS + 1))
