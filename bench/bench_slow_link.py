"""Data parallelism across two simulated hosts joined by a slow link, against the same two
hosts unthrottled: tokens/s of each and their ratio (scripts/sim_hosts.sh, torchrun).

The link is ``tc netem rate 100mbit delay 20ms`` on each host's interface (where the kernel
has no netem: the rate alone through tbf, said in the output). DDP all-reduces every
step's gradients over it; DiLoCo (``[diloco] islands = 2``, one island per host) syncs once
every ``inner_steps`` (H) and runs H + 1 steps, so its tokens/s includes one sync. tokens/s
is the mean over steps 2.. (tokens / summed step times, sync steps included). The default
model (hidden 512, 4 layers, 2 x 32 tokens per step) is chosen so that the throttled DDP
step is communication-bound (its gradient all-reduce is several times its compute).

    sudo python bench/bench_slow_link.py                     # the run docs/diloco.md quotes
    sudo python bench/bench_slow_link.py --hidden 256 --batch 8 --seq-len 64 --link "rate 100mbit delay 20ms"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from sim_hosts import SimHosts, free_port  # noqa: E402


def model_args(a: argparse.Namespace, run_dir: Path, steps: int) -> list[str]:
    return [
        f"--model.hidden={a.hidden}", f"--model.layers={a.layers}", "--model.heads=4", "--model.kv_heads=4",
        f"--model.ffn_hidden={a.hidden * 4}", f"--train.steps={steps}", f"--train.seq_len={a.seq_len}",
        f"--train.global_batch_size={a.batch}", "--train.eval_batches=0", "--train.device=cpu",
        "--metrics.log_interval=1", "--metrics.console=false", "--metrics.report=false", "--checkpoint.interval=0",
        f"--run.dir={run_dir}", "--run.overwrite=true",
    ]  # fmt: skip


def diloco_known() -> str | None:
    """None when this meshforge knows ``--diloco.islands``, else why the DiLoCo row is skipped."""
    r = subprocess.run(
        [sys.executable, "-m", "meshforge", "train", "--dry-run", "--diloco.islands=2"], capture_output=True, text=True
    )
    if "unknown config section [diloco]" in r.stderr or "unknown" in r.stderr and "diloco" in r.stderr:
        return "DiLoCo row skipped: this meshforge has no [diloco] section yet (--diloco.islands is an unknown key)"
    return None


def run_pair(link: str, extra: list[str], a: argparse.Namespace, steps: int) -> float:
    """Mean tokens/s over steps 2.. (sync steps included) of one run on two simulated hosts whose links are ``link``."""
    with SimHosts(2, link) as hosts, tempfile.TemporaryDirectory() as tmp:
        if hosts.fallback:
            print(f"  note: {hosts.fallback}; the link is not throttled")
        if hosts.notes:
            print("  " + hosts.notes.splitlines()[0])
        run_dir, port = Path(tmp) / "run", free_port() if hosts.fallback else 29400
        procs = []
        for i in range(2):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.addr(0)}:{port}", f"--rdzv-id={hosts.name}",
                f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={hosts.addr(i)}",
                "-m", "meshforge", "train", *model_args(a, run_dir, steps), *extra,
            ]  # fmt: skip
            procs.append(hosts.popen(i, cmd, out=open(Path(tmp) / f"h{i}.log", "w")))  # noqa: SIM115
        codes = [p.wait(timeout=a.timeout) for p in procs]
        if any(codes):
            raise SystemExit(f"a host failed ({codes}):\n" + (Path(tmp) / "h0.log").read_text()[-3000:])
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return a.batch * a.seq_len * len(recs[1:]) / sum(r["step_time_s"] for r in recs[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="DDP's steps (DiLoCo runs inner_steps + 1)")
    ap.add_argument("--link", default="rate 100mbit delay 20ms")
    ap.add_argument("--inner-steps", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    print(
        f"two simulated hosts, hidden {a.hidden}, layers {a.layers}, batch {a.batch} x {a.seq_len}, fp32 CPU; "
        f"slow link: {a.link}; DiLoCo H = {a.inner_steps}"
    )
    rows = [("DDP", [], a.steps)]
    why = diloco_known()
    if why is None:
        rows.append(("DiLoCo", ["--diloco.islands=2", f"--diloco.inner_steps={a.inner_steps}"], a.inner_steps + 1))
    fast = {}
    for name, extra, steps in rows:
        fast[name] = run_pair("", extra, a, steps)
        slow = run_pair(a.link, extra, a, steps)
        ratio = slow / fast[name]
        print(f"{name:7s} tokens/s unthrottled {fast[name]:9.0f}  slow link {slow:9.0f}  slow/fast {ratio:.3f}")
        fast[name + "-slow"] = slow
    if "DiLoCo" in fast:
        print(
            f"targets: DiLoCo/DDP on the slow link {fast['DiLoCo-slow'] / fast['DDP-slow']:.2f}x (>= 5); "
            f"DiLoCo slow/fast {fast['DiLoCo-slow'] / fast['DiLoCo']:.3f} (>= 0.8)"
        )
    else:
        print(why)


if __name__ == "__main__":
    main()
