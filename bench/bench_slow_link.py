"""Data parallelism across two simulated hosts joined by a slow link, against the same two
hosts unthrottled: tokens/s of each and their ratio (scripts/sim_hosts.sh, torchrun).

The link is ``tc netem rate 100mbit delay 20ms`` on each host's interface (where the kernel
has no netem: the rate alone through tbf, said in the output). DDP all-reduces every
step's gradients over it; DiLoCo (``[diloco] islands = 2``, one island per host) syncs once
every ``inner_steps`` and is the second row once the config knows the section (a note says
so otherwise).

    sudo python bench/bench_slow_link.py                     # debug-size model, 6 steps each
    sudo python bench/bench_slow_link.py --hidden 128 --steps 4 --link "rate 100mbit delay 20ms"
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


def model_args(a: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        f"--model.hidden={a.hidden}", f"--model.layers={a.layers}", "--model.heads=4", "--model.kv_heads=4",
        f"--model.ffn_hidden={a.hidden * 4}", f"--train.steps={a.steps}", "--train.seq_len=64",
        "--train.global_batch_size=8", "--train.eval_batches=0", "--train.device=cpu", "--metrics.log_interval=1",
        "--metrics.console=false", "--metrics.report=false", "--checkpoint.interval=0", f"--run.dir={run_dir}",
        "--run.overwrite=true",
    ]  # fmt: skip


def diloco_known() -> str | None:
    """None when this meshforge knows ``--diloco.islands``, else why the DiLoCo row is skipped."""
    r = subprocess.run(
        [sys.executable, "-m", "meshforge", "train", "--dry-run", "--diloco.islands=2"], capture_output=True, text=True
    )
    if "unknown config section [diloco]" in r.stderr or "diloco" in r.stderr and r.returncode:
        return "DiLoCo row skipped: this meshforge has no [diloco] section yet (--diloco.islands is an unknown key)"
    return None


def run_pair(link: str, extra: list[str], a: argparse.Namespace) -> float:
    """Median tokens/s (steps 2..) of one run on two simulated hosts whose links are ``link``."""
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
                "-m", "meshforge", "train", *model_args(a, run_dir), *extra,
            ]  # fmt: skip
            procs.append(hosts.popen(i, cmd, out=open(Path(tmp) / f"h{i}.log", "w")))  # noqa: SIM115
        codes = [p.wait(timeout=a.timeout) for p in procs]
        if any(codes):
            raise SystemExit(f"a host failed ({codes}):\n" + (Path(tmp) / "h0.log").read_text()[-3000:])
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        tps = sorted(r["tokens_per_s"] for r in recs[1:])
        return tps[len(tps) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--link", default="rate 100mbit delay 20ms")
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    print(f"two simulated hosts, hidden {a.hidden}, layers {a.layers}, fp32 CPU; slow link: {a.link}")
    rows = [("DDP", [])]
    why = diloco_known()
    if why is None:
        rows.append(("DiLoCo", ["--diloco.islands=2", f"--diloco.inner_steps={a.inner_steps}"]))
    fast = {}
    for name, extra in rows:
        fast[name] = run_pair("", extra, a)
        slow = run_pair(a.link, extra, a)
        ratio = slow / fast[name]
        print(f"{name:7s} tokens/s unthrottled {fast[name]:9.0f}  slow link {slow:9.0f}  slow/fast {ratio:.3f}")
        fast[name + "-slow"] = slow
    if "DiLoCo" in fast:
        print(f"DiLoCo/DDP on the slow link: {fast['DiLoCo-slow'] / fast['DDP-slow']:.2f}x")
    else:
        print(why)


if __name__ == "__main__":
    main()
