"""DiLoCo against DDP at equal tokens: final validation loss and cross-island traffic.

Four gloo ranks train the debug model the same number of steps on the same global batches
(the sampler gives each island its own slice of every global batch, so DDP's ranks and the
islands see the same tokens): DDP over 4 ranks; DiLoCo with 4 islands of one rank, H = 50
(AdamW inside, Nesterov SGD lr 0.7 / momentum 0.9 outside); Streaming DiLoCo with 2
fragments and delay 5, in fp32 and in bf16. Bytes come from the communication counters
(parallel/comm_stats.py) on the logged steps (every 5th, which includes every send).
Printed as ratios: validation loss vs DDP (target within 3%), bytes per step vs DDP's
(target <= 1/H), peak bytes in one sync vs DiLoCo's (target <= 1/fragments).

    python bench/bench_diloco.py [--steps 200 --inner-steps 50 --batch 16 --seq-len 128]
    python bench/bench_diloco.py --warmup-steps 100 --only diloco   # 100 DDP steps, then 2 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(name: str, root: Path, args: argparse.Namespace, extra: dict) -> dict:
    d = root / name
    over = {
        "model.preset": "debug", "train.steps": args.steps, "train.global_batch_size": args.batch,
        "train.seq_len": args.seq_len, "train.device": "cpu", "train.eval_batches": args.eval_batches,
        "metrics.log_interval": 5, "metrics.console": False, "metrics.tensorboard": False,
        "metrics.report": False, "checkpoint.save_final": False, "run.dir": str(d), **extra,
    }  # fmt: skip
    flags = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()]
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "4", *flags]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    axis = "island" if "diloco.islands" in extra else None  # DDP: every axis (its dp group spans the world)
    by = [r.get("comm_bytes_by_kind", {}) for r in recs]
    per_step = [sum(sum(k.values()) for a, k in b.items() if axis in (None, a)) for b in by]
    h = args.inner_steps if axis == "island" else 5  # one round's logged steps hold every send of it
    w = extra.get("diloco.warmup_steps", 0)  # the first round starts after the warm-up's DDP steps
    first = [b for r, b in zip(recs, per_step, strict=True) if w < r["step"] <= w + h]
    round_bytes = sum(first) if axis == "island" else per_step[0]
    summary = json.loads((d / "summary.json").read_text())
    print(f"{name}: val loss {summary['val_loss']:.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
    return {
        "val_loss": summary["val_loss"],
        "bytes_per_step": round_bytes / args.inner_steps if axis == "island" else round_bytes,
        "peak_sync_bytes": max(b for r, b in zip(recs, per_step, strict=True) if r["step"] > w),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--warmup-steps", type=int, default=0, help="diloco.warmup_steps: DDP over all islands first")
    p.add_argument("--inner-lr", type=float, default=None, help="optim.lr of the DiLoCo runs (default: DDP's, 3e-3)")
    p.add_argument("--only", default="", help="comma-separated subset of ddp,diloco,streaming-fp32,streaming-bf16")
    args = p.parse_args()
    h = args.inner_steps
    outer = {
        "diloco.outer_lr": args.outer_lr,
        "diloco.outer_momentum": args.outer_momentum,
        "diloco.warmup_steps": args.warmup_steps,
    }
    diloco = {"diloco.islands": 4, "diloco.inner_steps": h, **outer}
    if args.inner_lr is not None:
        diloco["optim.lr"] = args.inner_lr
    streaming = {**diloco, "diloco.fragments": 2, "diloco.delay": 5}
    runs = {
        "ddp": {},
        "diloco": diloco,
        "streaming-fp32": streaming,
        "streaming-bf16": {**streaming, "diloco.sync_dtype": "bf16"},
    }
    keep = set(args.only.split(",")) if args.only else set(runs)
    runs = {k: v for k, v in runs.items() if k in keep | {"ddp", "diloco"}}
    with tempfile.TemporaryDirectory() as tmp:
        out = {name: run(name, Path(tmp), args, extra) for name, extra in runs.items()}
    ddp, dl = out["ddp"], out["diloco"]
    print(f"4 ranks, debug model, {args.steps} steps x {args.batch} x {args.seq_len} tokens (equal tokens), H = {h}")
    print(
        f"{'run':16} {'val loss':>9} {'vs DDP':>8} {'bytes/step':>12} {'vs DDP':>9} {'peak/sync':>11} {'vs DiLoCo':>9}"
    )
    for name, r in out.items():
        print(
            f"{name:16} {r['val_loss']:9.4f} {r['val_loss'] / ddp['val_loss']:8.4f} {r['bytes_per_step']:12.0f} "
            f"{r['bytes_per_step'] / ddp['bytes_per_step']:9.5f} {r['peak_sync_bytes']:11.0f} "
            f"{r['peak_sync_bytes'] / dl['peak_sync_bytes']:9.3f}   ({r['wall_s']:.0f} s wall)"
        )
    if "streaming-fp32" not in out:
        print(f"target: DiLoCo val loss within 3% of DDP's: {dl['val_loss'] / ddp['val_loss'] - 1:+.2%}")
        return
    print(
        f"targets: DiLoCo val loss within 3% of DDP's: {dl['val_loss'] / ddp['val_loss'] - 1:+.2%}; "
        f"bytes/step <= 1/H = {1 / h:.4f} of DDP's: {dl['bytes_per_step'] / ddp['bytes_per_step']:.5f}; "
        f"streaming peak per sync <= 1/2 of DiLoCo's: "
        f"{out['streaming-fp32']['peak_sync_bytes'] / dl['peak_sync_bytes']:.3f}"
    )


if __name__ == "__main__":
    main()
