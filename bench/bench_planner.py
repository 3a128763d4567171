"""Planner predictions against measured step times on this machine.

Calibrates the machine (``meshforge calibrate``) as 1 rank and as 2 ranks, then for one
model trains each local layout for a few steps with ``meshforge train`` and compares the
median measured step time with the prediction of ``meshforge plan --config
RUN/config.toml --hardware PROFILE`` for exactly that run (the resolved config fixes every
choice, so the planner estimates that one layout). No
constant is fitted to these runs: the profile comes from micro-benchmarks alone.
Target (issue 7): within 25%.

    python bench/bench_planner.py
    python bench/bench_planner.py --debug --repeat 2   # issue 18's protocol

``--debug``: the debug preset, seq_len 128, global batch 8, micro-batch 2, fp32, 12 steps,
every layout planned with one fresh ``meshforge calibrate --nproc 2`` profile per round;
each round prints the machine's load (``uptime``), since the machine may be shared.

``--load N``: N busy processes (a Python spin loop each) run through calibration and every
training run, as on a machine shared with other work (issue 51: calibrate under the load of 2
busy processes on 2 cores, then plan runs made under the same load: each within ±25%).

    python bench/bench_planner.py --load 2 --repeat 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from small_model import small_model

LAYOUTS = {  # name: (ranks, overrides)
    "single process": (1, {}),
    "dp 2 (DDP)": (2, {"parallel.zero_stage": 0}),
    "dp 2 (ZeRO-3)": (2, {"parallel.zero_stage": 3}),
    "tp 2 (+SP)": (2, {"parallel.tp": 2}),
    "pp 2 (1F1B, m 4)": (2, {"parallel.pp": 2, "parallel.num_microbatches": 4}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeat", type=int, default=1, help="calibrate and measure again, N rounds in all")
    p.add_argument("--debug", action="store_true", help="the debug preset with issue 18's settings")
    p.add_argument("--quick", action="store_true", help="meshforge calibrate --quick (fewer sizes and repeats)")
    p.add_argument("--load", type=int, default=0, help="busy processes running throughout (a shared machine)")
    args = p.parse_args()
    if args.debug:  # the debug preset's shape, for the printout
        args.hidden, args.layers, args.seq_len, args.batch = 128, 4, 128, 8
    ratios: dict[str, list[float]] = {}
    with busy(args.load):
        for i in range(args.repeat):
            if args.repeat > 1:
                print(f"\n== round {i + 1} of {args.repeat}")
            for name, r in one_round(args).items():
                ratios.setdefault(name, []).append(r)
    if args.repeat > 1:
        print(f"\n{'layout':<16} predicted/measured per round, median")
        for name, rs in ratios.items():
            print(f"{name:<16} {' '.join(f'{r:.2f}' for r in rs)}  median {statistics.median(rs):.2f}")


def one_round(args: argparse.Namespace) -> dict[str, float]:
    """Calibrate, train each layout, plan it; print the table, return predicted/measured."""
    from meshforge.planner.hardware import get_hardware

    tmp = Path(tempfile.mkdtemp())
    print(f"load before calibrating: {_load()}")
    profiles = {}
    for n in (2,) if args.debug else (1, 2):
        out = tmp / f"hw{n}.json"
        cmd = [sys.executable, "-m", "meshforge", "calibrate", "--nproc", str(n), "--out", str(out)] + (
            ["--quick"] if args.quick else []
        )
        subprocess.run(cmd, check=True, capture_output=True)
        profiles[n] = get_hardware(None, str(out))
    if args.debug:  # one 2-rank profile for every layout, as the issue measures it
        (tmp / "hw1.json").write_text((tmp / "hw2.json").read_text())
    model = {"model.preset": "debug", "train.seq_len": 128, "train.micro_batch_size": 2} if args.debug else None
    shape_over = {
        **(model or small_model(args.hidden, args.layers, args.seq_len)),
        "train.global_batch_size": 8 if args.debug else args.batch,
        "train.steps": args.steps,
        "train.precision": "fp32",
        "train.eval_batches": 0,
        "optim.warmup_steps": 1,
        "metrics.log_interval": 1,
        "metrics.console": False,
        "checkpoint.save_final": False,
    }
    rows = []
    for name, (n, extra) in LAYOUTS.items():
        run = tmp / "".join(c if c.isalnum() else "_" for c in name)
        over = {**shape_over, **extra, "run.dir": str(run)}
        cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", str(n)] + [
            f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        measured = statistics.median(x["step_time_s"] for x in recs[2:])
        plan = [sys.executable, "-m", "meshforge", "plan", "--config", str(run / "config.toml")]
        plan += ["--hardware", str(tmp / f"hw{n}.json"), "--gpus", str(n), "--gpus-per-node", str(n), "--json"]
        r = subprocess.run(plan, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"plan for {name} failed:\n{r.stderr[-3000:]}")
        layouts = json.loads(r.stdout)["layouts"]
        assert len(layouts) == 1, "the resolved config fixes every choice"
        e = layouts[0]
        rows.append((name, measured, e["step_time_s"], e))
    print(f"load after training: {_load()}")
    print(
        f"model: {'debug preset: ' if args.debug else ''}hidden {args.hidden}, {args.layers} layers "
        f"({rows[0][3]['num_params'] / 1e6:.2f}M parameters), "
        f"batch {args.batch} x {args.seq_len}, fp32; profiles: "
        + "; ".join(
            f"{n} rank(s): {p.peak_flops['fp32'] / 1e9:.0f} GFLOP/s/rank, all-reduce {p.intra_bw / 1e9:.2f} GB/s"
            + "".join(f", as {k} rank: {f['peak_flops']['fp32'] / 1e9:.0f} GFLOP/s" for k, f in p.by_ranks.items())
            for n, p in profiles.items()
        )
    )
    print(
        f"\n{'layout':<16} {'measured s':>11} {'predicted s':>12} {'predicted/measured':>19}  largest predicted parts"
    )
    for name, meas, pred, e in rows:
        parts = sorted(
            ((k, v) for k, v in e["time_s"].items() if k not in ("ideal_compute", "dp_comm_total")),
            key=lambda kv: -kv[1],
        )
        top = ", ".join(f"{k} {v:.3f}" for k, v in parts[:3])
        print(f"{name:<16} {meas:>11.3f} {pred:>12.3f} {pred / meas:>18.2f}x  {top}")
    return {name: pred / meas for name, meas, pred, _ in rows}


@contextlib.contextmanager
def busy(n: int):
    """``n`` spinning processes for the duration (each takes a core when it can)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    if n:
        print(f"{n} busy process(es) running throughout")
    try:
        yield
    finally:
        for q in procs:
            q.kill()
            q.wait()


def _load() -> str:
    """The 1/5/15-minute load averages (the machine may be shared: timings are noisy)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
