"""What the health detectors cost a step: all on against all off, in the same run.

Two gloo ranks (DDP) train a small model; the steps run in blocks, detectors on and off
alternating (on: the step guard's host read of the gradient norm, spike detection with
on_spike = log, the default: each step's loss kept, the losses reduced together on the
logged step; the straggler gather on logged steps, forward timing hooks; off: none of
them). In both: the PyTorch flight recorder, which the watchdog reads (it is set before the
process group starts), and the watchdog thread with its per-step beat. Step time is the
host clock per step (CPU: no device to wait for). Printed: ms/step median over blocks for both,
and the ratio on/off three ways: of the medians, the median of the ratios of neighbouring
(off, on) blocks (robust to a machine whose load drifts), and of the best blocks (1.00:
free; the target is within 1%).

    python bench/bench_health.py [--blocks 40 --block-steps 10 --hidden 256 --layers 2 --seq-len 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ranks import run_workers
from small_model import small_model


def worker(args: argparse.Namespace) -> None:
    from meshforge.config import load_config
    from meshforge.guards.preflight import follower_plan, preflight
    from meshforge.health.flight_recorder import ENV
    from meshforge.launch.env import rank, world_size
    from meshforge.parallel.mesh import build_mesh, shutdown
    from meshforge.train.loop import Trainer, agree_on_start
    from meshforge.train.run_dir import prepare_run_dir

    os.environ.setdefault(*ENV)
    steps = args.block_steps * (args.blocks + 1)
    over = {
        **small_model(args.hidden, args.layers, args.seq_len),
        "train.global_batch_size": args.batch, "train.steps": steps, "train.device": "cpu",
        "train.eval_batches": 0, "metrics.log_interval": args.block_steps, "metrics.console": False,
        "metrics.tensorboard": False, "checkpoint.save_final": False, "run.dir": args.run_dir,
        "health.spike_threshold": 6.0, "health.hang_timeout_s": 300.0, "health.straggler_factor": 1.5,
    }  # fmt: skip
    cfg = load_config(None, over)
    cfg = preflight(cfg, world_size()) if rank() == 0 else follower_plan(cfg, world_size())
    if rank() == 0:
        prepare_run_dir(cfg)
    mesh = build_mesh(cfg.layout, "cpu")
    cfg, _ = agree_on_start(cfg, mesh)
    tr = Trainer(cfg, mesh)
    guard, in_guard = tr.health.guard, [0.0]
    check = guard.allow_update

    def timed_check(*a, **k):  # the guard's own time, inside the "on" blocks: a second, direct figure
        t = time.perf_counter()
        try:
            return check(*a, **k)
        finally:
            in_guard[0] += time.perf_counter() - t

    guard.allow_update = timed_check
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(args.blocks + 1):
        on = block % 2 == 1  # block 0 (warm-up, off) is not counted
        tr.health.pause(not on)
        t_block = time.perf_counter()
        for _ in range(args.block_steps):
            n = tr.state.step + 1
            logged = n % args.block_steps == 0
            tr.health.before_step(n, logged)
            tr.instruments.before_step(n, time.perf_counter(), measured=logged)
            result = tr.step_once(measure=logged)
            tr.instruments.after_step(n)
            tr.health.after_step(n)
            if logged:
                tr.log.metrics.add(1e-3, result)
                tr.log.metrics.record(n, tr.state.tokens_seen, result, {})  # the logged step's gathers
        if block:
            times[on].append((time.perf_counter() - t_block) / args.block_steps)
    tr.health.close()
    tr.instruments.close()
    if mesh.is_main:
        report(args, times, in_guard[0])
    shutdown(True)


def report(args: argparse.Namespace, times: dict[bool, list[float]], guard_s: float) -> None:
    """Print the table and the ratios (rank 0)."""
    on, off = statistics.median(times[True]), statistics.median(times[False])
    guard_ms = guard_s / (len(times[True]) * args.block_steps)
    pairs = statistics.median(a / b for a, b in zip(times[True], times[False], strict=False))  # neighbours
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq_len} tokens, fp32, "
        f"2 gloo ranks (DDP), {args.blocks} blocks of {args.block_steps} steps alternating\n"
        f"\n{'detectors':<10} {'ms/step (median of blocks)':>28}\n{'off':<10} {1e3 * off:>28.2f}\n"
        f"{'on':<10} {1e3 * on:>28.2f}\n\nratio on/off: medians {on / off:.4f}, "
        f"median of neighbouring block pairs {pairs:.4f}, best blocks {min(times[True]) / min(times[False]):.4f}\n"
        f"time inside the step guard (grad-norm host read, logged steps' loss reduction, spike test): "
        f"{1e3 * guard_ms:.3f} ms/step = {guard_ms / off:.2%} of an off step",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--block-steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.run_dir = str(Path(tempfile.mkdtemp()) / "run")
    sys.exit(run_workers(__file__, args, 2))


if __name__ == "__main__":
    main()
