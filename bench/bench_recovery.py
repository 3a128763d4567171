"""Recovery under repeated host failures, side by side: goodput, time from a kill to the survivors'
next step, and steps lost, for (a) elastic restart from the disk checkpoint, (b) elastic restart from
peer memory (checkpoint.memory_interval) and (c) live recovery across replica groups (torchft).

Three simulated hosts (scripts/sim_hosts.sh; loopback addresses where namespaces are not
permitted). Every ``--kill-every`` seconds one host is SIGKILLed and started again ``--down``
seconds later, hosts 1 and 2 in turn (host 0 holds what both modes need to stay up: torchrun's
rendezvous store in (a), the lighthouse in (c), so it is never killed). (a): one torchrun job,
``--nnodes 1:3 --max-restarts 100``, ``checkpoint.interval = --ckpt-interval``. (b): (a) plus
``checkpoint.memory_interval = --mem-interval`` (each host's keeper holds the snapshots, mirrored to the
next host; a restart loads the newest one every rank can fetch, else disk). (c): three replica
groups of one rank each, ``fault_tolerance.replicas = 3, min_replicas = 1``, host 0's group
measured, the same checkpoint interval (written by one group). Both train the same model on the
same global batch.

- goodput: the step time of the steps that count (the rows the run keeps in metrics.jsonl: (a)
  trims the rows a restart redoes) over the wall time of the measured window (from ``--settle``
  s after the first step, for ``--minutes``);
- kill -> next step: seconds from a kill to the first step the measured run logs after it (a
  watcher reads metrics.jsonl every 50 ms; a row that lands within two median step times of the
  kill was in flight at it and is not "next"); a host's return (a restart in (a)) is timed too;
- steps lost: steps logged before a kill that were logged again after it (redone).

    sudo python bench/bench_recovery.py                                   # the issue's run: 10 min, kill every 2 min
    sudo python bench/bench_recovery.py --minutes 4 --kill-every 60       # shorter
    sudo python bench/bench_recovery.py --modes disk,memory --minutes 4 --kill-every 60   # (a) beside (b)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from sim_hosts import SimHosts, free_port  # noqa: E402

PY = sys.executable


def model_args(a: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        f"--model.hidden={a.hidden}", f"--model.layers={a.layers}", "--model.heads=4", "--model.kv_heads=4",
        f"--model.ffn_hidden={a.hidden * 4}", "--train.steps=1000000", f"--train.seq_len={a.seq_len}",
        f"--train.global_batch_size={a.batch}", "--train.eval_batches=0", "--train.device=cpu",
        "--metrics.log_interval=1", "--metrics.console=false", "--metrics.report=false",
        f"--checkpoint.interval={a.ckpt_interval}", "--checkpoint.keep=2", f"--run.dir={run_dir}",
        "--health.hang_timeout_s=0", "--train.skip_memory_check=true",
    ]  # fmt: skip


class Watcher(threading.Thread):
    """Reads a metrics.jsonl every 50 ms; ``arrivals``: (time, step) of each row when it appeared."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.arrivals, self.stop = path, [], False

    def run(self) -> None:
        prev: list[str] = []
        while not self.stop:
            try:
                lines = [x for x in self.path.read_text().splitlines() if x.endswith("}")]
            except OSError:
                lines = []
            same = next(
                (i for i, (a, b) in enumerate(zip(lines, prev, strict=False)) if a != b), min(len(lines), len(prev))
            )
            if len(lines) > same:  # rows past what was read before (after a trim: the redone steps, new times)
                now = time.time()
                self.arrivals += [(now, json.loads(x)["step"]) for x in lines[same:]]
                prev = lines
            # else: the same rows, or a prefix of them (a trim, or a read in the middle of its rewrite)
            time.sleep(0.05)


def disk_mode(hosts: SimHosts, a: argparse.Namespace, tmp: Path, extra: tuple = ()) -> tuple[Path, callable]:
    """(a): one elastic torchrun job over the three hosts; returns its metrics file and a starter per host."""
    run_dir, port = tmp / "run", free_port() if hosts.fallback else 29400
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}

    def start(i: int) -> None:
        cmd = [
            PY, "-m", "torch.distributed.run", "--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=100",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.addr(0)}:{port}", f"--rdzv-id={hosts.name}",
            f"--rdzv-conf=is_host={int(i == 0)},join_timeout=60", f"--local-addr={hosts.addr(i)}",
            "-m", "meshforge", "train", *model_args(a, run_dir), "--checkpoint.load=latest", *extra,
        ]  # fmt: skip
        own = {**env, "MESHFORGE_HOST": hosts.addr(i)}  # (the memory keeper's address: loopback hosts too)
        hosts.popen(i, cmd, own, open(tmp / f"h{i}-{time.time():.0f}.log", "w"))  # noqa: SIM115

    return run_dir / "metrics.jsonl", start


def memory_mode(hosts: SimHosts, a: argparse.Namespace, tmp: Path) -> tuple[Path, callable]:
    """(b): (a) with checkpoints in memory every ``--mem-interval`` steps, mirrored to the next host."""
    return disk_mode(hosts, a, tmp, (f"--checkpoint.memory_interval={a.mem_interval}",))


def live_mode(hosts: SimHosts, a: argparse.Namespace, tmp: Path) -> tuple[Path, callable]:
    """(c): a lighthouse and one replica group per host; returns group 0's metrics file and a starter."""
    port = free_port() if hosts.fallback else 29510
    lighthouse = [PY, "-m", "meshforge", "lighthouse", "--bind", f"{hosts.addr(0)}:{port}", "--min-replicas", "1"]
    hosts.popen(0, lighthouse, {}, open(tmp / "lighthouse.log", "w"))  # noqa: SIM115
    time.sleep(3)
    env = {"OMP_NUM_THREADS": "1"}

    def start(i: int) -> None:
        ft = [
            "--fault_tolerance.enabled=true", f"--fault_tolerance.lighthouse=http://{hosts.addr(0)}:{port}",
            "--fault_tolerance.replicas=3", f"--fault_tolerance.replica_id={i}",
            f"--fault_tolerance.timeout_s={a.ft_timeout}",
        ]  # fmt: skip
        cmd = [PY, "-m", "meshforge", "train", *model_args(a, tmp / f"g{i}"), *ft]
        hosts.popen(i, cmd, env, open(tmp / f"h{i}-{time.time():.0f}.log", "w"))  # noqa: SIM115

    return tmp / "g0" / "metrics.jsonl", start


MODES = {"disk": disk_mode, "memory": memory_mode, "live": live_mode}


class _kept:
    """A folder that stays (``--logs``), used like a TemporaryDirectory."""

    def __init__(self, root: str, mode: str):
        self.path = Path(root) / mode
        self.path.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> str:
        return str(self.path)

    def __exit__(self, *exc: object) -> None:
        pass


def measure(mode: str, a: argparse.Namespace) -> dict:
    """One mode's run: start the hosts, kill and restart them on the schedule, read the metrics."""
    with SimHosts(3) as hosts, tempfile.TemporaryDirectory() if a.logs is None else _kept(a.logs, mode) as t:
        tmp = Path(t)
        metrics, start = MODES[mode](hosts, a, tmp)
        for i in range(3):
            start(i)
        watch = Watcher(metrics)
        watch.start()
        while not watch.arrivals:
            time.sleep(0.2)
        time.sleep(a.settle)
        t0 = time.time()
        kills, returns, victim = [], [], 1
        while time.time() < t0 + a.minutes * 60:
            nxt = t0 + (len(kills) + 1) * a.kill_every
            if nxt >= t0 + a.minutes * 60:
                time.sleep(max(0.0, t0 + a.minutes * 60 - time.time()))
                break
            time.sleep(max(0.0, nxt - time.time()))
            hosts.kill(victim)
            kills.append(time.time())
            time.sleep(a.down)
            start(victim)
            returns.append(time.time())
            victim = 3 - victim
        t1 = time.time()
        watch.stop = True
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
        for i in range(3):
            hosts.kill(i)
        return summarize(mode, rows, watch.arrivals, kills, returns, t0, t1)


def summarize(mode, rows, arrivals, kills, returns, t0, t1) -> dict:
    """Goodput, kill -> next step, steps lost (see the module's docstring)."""
    inside = [(t, s) for t, s in arrivals if t0 <= t <= t1]
    kept = {r["step"]: r["step_time_s"] for r in rows}
    goodput = sum(kept[s] for s in {s for _, s in inside} if s in kept) / (t1 - t0)
    guard = 2 * statistics.median(kept.values())  # a step in flight at the kill lands within this: not "next"
    after: list[float | None] = []
    lost: list[int | None] = []
    for k in [*kills, *returns]:
        before = [s for t, s in arrivals if t < k + guard]
        nxt = [(t, s) for t, s in arrivals if t > k + guard]
        after.append(nxt[0][0] - k if nxt else None)
        lost.append(max(0, max(before, default=0) - nxt[0][1] + 1) if nxt else None)
    steps = [s for _, s in inside]
    n = len(kills)
    return {
        "mode": mode, "goodput": goodput, "kill_to_step_s": after[:n], "return_to_step_s": after[n:],
        "steps_lost": lost[:n], "steps_lost_on_return": lost[n:],
        "steps": (min(steps), max(steps)) if steps else (0, 0),
        "median_step_s": statistics.median(kept.values()), "window_s": t1 - t0,
        "replicas": sorted({r.get("replicas") for r in rows if "replicas" in r}),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=float, default=120.0)
    ap.add_argument("--down", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=15.0)
    ap.add_argument("--ckpt-interval", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--mem-interval", type=int, default=5, help="(b): checkpoint.memory_interval")
    ap.add_argument("--modes", default="disk,memory,live", help="of disk (a), memory (b), live (c)")
    ap.add_argument("--logs", default=None, help="keep each mode's run directories and host logs under this folder")
    ap.add_argument("--ft-timeout", type=float, default=10.0, help="(c): fault_tolerance.timeout_s")
    a = ap.parse_args()
    print(f"3 simulated hosts, {a.minutes:g} min, a host killed every {a.kill_every:g} s and back {a.down:g} s later")
    out = [measure(m, a) for m in a.modes.split(",")]
    print(f"{'mode':6} {'goodput':>8} {'kill->step s':>22} {'return->step s':>22} {'lost':>10} {'step s':>7} steps")
    fmt = lambda xs, f="{:.1f}": ",".join("-" if x is None else f.format(x) for x in xs)  # noqa: E731
    for r in out:
        print(
            f"{r['mode']:6} {r['goodput']:8.1%} {fmt(r['kill_to_step_s']):>22} {fmt(r['return_to_step_s']):>22} "
            f"{fmt(r['steps_lost'], '{}'):>10} {r['median_step_s']:7.3f} {r['steps']} {r['replicas']}"
        )
    print(json.dumps(out))
    by = {r["mode"]: r["goodput"] for r in out}
    for m in ("memory", "live"):
        if "disk" in by and m in by:
            print(f"goodput {m} / disk: {by[m] / max(by['disk'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
