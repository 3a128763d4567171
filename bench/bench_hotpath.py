"""What measurement costs a step: metrics.log_interval 1 against 100, under DDP and pp 2.

Measurement (reading the loss and grad norm, reducing the loss, counting state bytes and
communication, the pipeline's barrier and statistics gather, agreeing on a stop request)
runs on logged steps only, so a run that logs every step pays for it every step and one
that logs every 100th almost never. Each layout trains the same small model for
``--steps`` steps on 2 gloo ranks through ``meshforge train --nproc 2``, once per setting
and round, the settings alternating; step time = tokens per step / the summary's tokens/s
(which leaves out the first 10% of steps). Printed per setting: the best and the median
over rounds (on a shared machine the best run is the least disturbed one) and the ratios
log1 / log100 of both (1.0: measurement is free; above 1: what logging every step costs).

    python bench/bench_hotpath.py [--steps 150 --rounds 5 --hidden 128 --layers 2 --seq-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from small_model import small_model

LAYOUTS = {
    "ddp": {"parallel.dp_shard": 2, "parallel.zero_stage": 0},
    "pp2 1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
}


def step_time(tmp: Path, layout: str, log_interval: int, args: argparse.Namespace, round_: int) -> float:
    """Seconds per step of one run (2 ranks), from its summary."""
    d = tmp / f"{layout.replace(' ', '-')}-log{log_interval}-r{round_}"
    over = {
        **small_model(args.hidden, args.layers, args.seq_len),
        **LAYOUTS[layout],
        "train.global_batch_size": args.batch,
        "train.steps": args.steps,
        "train.precision": "fp32",
        "train.device": "cpu",
        "train.eval_batches": 0,
        "metrics.log_interval": log_interval,
        "metrics.console": False,
        "checkpoint.save_final": False,
        "run.dir": str(d),
    }
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2"]
    cmd += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{layout} log_interval={log_interval} failed:\n{r.stderr[-3000:]}")
    summary = json.loads((d / "summary.json").read_text())
    return args.batch * args.seq_len / summary["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    times: dict[tuple[str, int], list[float]] = {(lay, li): [] for lay in LAYOUTS for li in (1, 100)}
    for r in range(args.rounds):
        for layout in LAYOUTS:
            for li in (1, 100):
                times[(layout, li)].append(step_time(tmp, layout, li, args, r))
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq_len} tokens, fp32, "
        f"2 gloo ranks, {args.steps} steps, {args.rounds} rounds; ms/step best (median)"
    )
    print(f"\n{'layout':<10} {'log 1':>16} {'log 100':>16} {'log1/log100 best':>17} {'(median)':>9}")
    for layout in LAYOUTS:
        one, hundred = times[(layout, 1)], times[(layout, 100)]
        a, b = min(one), min(hundred)
        ma, mb = statistics.median(one), statistics.median(hundred)
        cell = lambda x, m: f"{1e3 * x:.2f} ({1e3 * m:.2f})"  # noqa: E731
        print(f"{layout:<10} {cell(a, ma):>16} {cell(b, mb):>16} {a / b:>17.2f} {ma / mb:>9.2f}")


if __name__ == "__main__":
    main()
