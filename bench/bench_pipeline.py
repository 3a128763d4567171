"""Pipeline bubble: measured against the formula, and tokens/s, per schedule.

For p in {2, 4} and m in {2, 4, 8, 16} micro-batches (one sequence each) it trains one
model with GPipe and 1F1B through ``meshforge train --nproc p``, and at p = 2 interleaved
1F1B (2 chunks per rank) and the zero-bubble schedule next to plain 1F1B. The measured
bubble is each rank's idle share of a step (the span of the step minus the time inside
its forward/backward actions, from the executed timeline), averaged over the ranks and
over the steps after the first; theory is (p-1)/(m+p-1), divided by v for interleaving.
m < p cannot fill the pipeline and is refused by meshforge, so it is shown as such.

    python bench/bench_pipeline.py [--hidden 256 --layers 8 --seq-len 128 --steps 6]
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


def run(tmp: Path, p: int, m: int, schedule: str, v: int, args: argparse.Namespace) -> dict | None:
    d = tmp / f"{schedule}-p{p}-m{m}-v{v}"
    over = {
        **small_model(args.hidden, args.layers, args.seq_len),
        "train.global_batch_size": m,
        "train.steps": args.steps,
        "train.precision": "fp32",
        "train.eval_batches": 0,
        "optim.warmup_steps": 1,
        "parallel.pp": p,
        "parallel.pp_schedule": schedule,
        "parallel.pp_virtual_stages": v,
        "parallel.num_microbatches": m,
        "metrics.log_interval": 1,
        "metrics.console": False,
        "checkpoint.save_final": False,
        "run.dir": str(d),
    }
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", str(p)] + [
        f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // p))}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode == 2 and "cannot fill" in r.stderr:  # refused before start: m < p
        return None
    if r.returncode:
        sys.exit(f"{schedule} p={p} m={m} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()][1:]
    return {
        "bubble": statistics.median(x["bubble_fraction"] for x in recs),
        "theory": recs[0]["bubble_theory"],
        "tokens_per_s": statistics.median(x["tokens_per_s"] for x in recs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    print(f"model: hidden {args.hidden}, {args.layers} layers, micro-batch 1 x {args.seq_len} tokens, fp32, gloo")
    print(f"\n{'schedule':<18} {'p':>2} {'m':>3} {'measured':>9} {'theory':>7} {'meas/theory':>12} {'tokens/s':>9}")
    cases = [(s, p, m, 1) for p in (2, 4) for s in ("gpipe", "1f1b") for m in (2, 4, 8, 16)]
    cases += [(s, 2, m, 2) for s in ("interleaved_1f1b", "zero_bubble") for m in (2, 4, 8, 16)]
    for schedule, p, m, v in cases:
        r = run(tmp, p, m, schedule, v, args)
        name = schedule + (f" v={v}" if v > 1 else "")
        if r is None:
            print(f"{name:<18} {p:>2} {m:>3} {'refused: m < p (cannot fill the pipeline)':>43}")
            continue
        ratio = r["bubble"] / r["theory"] if r["theory"] else float("nan")
        print(
            f"{name:<18} {p:>2} {m:>3} {r['bubble']:>9.3f} {r['theory']:>7.3f} {ratio:>12.2f} "
            f"{r['tokens_per_s']:>9.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
