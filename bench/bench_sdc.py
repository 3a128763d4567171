"""What the silent-data-corruption check costs, and whether it ever raises a false alarm.

Cost: two gloo ranks (DDP) train a small model in one run; the steps run in blocks of
``--block-steps``, the check on (``health.sdc_interval = --interval``, so due once per block at
the default 10) and off alternating; printed: ms/step median of each and the ratio on/off (of the
medians, and the median of neighbouring block pairs), and the check's own time per call (a
fingerprint of every parameter shard, one all-gather of one int64 per parameter, one flag
all-reduce) as a share of a step at the interval. False alarms: ``meshforge train --nproc 2``
for ``--clean-steps`` steps (default 1,000) with the check on every step, in fp32 and bf16;
printed: the sdc events each found (0 expected).

    python bench/bench_sdc.py [--blocks 40 --block-steps 10 --interval 10 --clean-steps 1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ranks import run_workers
from small_model import small_model


def worker(args: argparse.Namespace) -> None:
    from meshforge.config import load_config
    from meshforge.guards.preflight import follower_plan, preflight
    from meshforge.launch.env import rank, world_size
    from meshforge.parallel.mesh import build_mesh, shutdown
    from meshforge.train.loop import Trainer, agree_on_start
    from meshforge.train.run_dir import prepare_run_dir

    over = {
        **small_model(args.hidden, args.layers, args.seq_len),
        "train.global_batch_size": args.batch, "train.steps": args.block_steps * (args.blocks + 1),
        "train.device": "cpu", "train.eval_batches": 0, "metrics.log_interval": 10**6, "metrics.console": False,
        "metrics.tensorboard": False, "checkpoint.save_final": False, "run.dir": args.run_dir,
        "health.sdc_interval": args.interval,
    }  # fmt: skip
    cfg = load_config(None, over)
    cfg = preflight(cfg, world_size()) if rank() == 0 else follower_plan(cfg, world_size())
    if rank() == 0:
        prepare_run_dir(cfg)
    mesh = build_mesh(cfg.layout, "cpu")
    cfg, _ = agree_on_start(cfg, mesh)
    tr = Trainer(cfg, mesh)
    sdc, in_check = tr.health.sdc, []
    check = sdc.check

    def timed_check(step: int):
        t = time.perf_counter()
        try:
            return check(step)
        finally:
            in_check.append(time.perf_counter() - t)

    sdc.check = timed_check
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(args.blocks + 1):
        on = block % 2 == 1  # block 0 (warm-up, off) is not counted
        sdc.interval = args.interval if on else 0
        t_block = time.perf_counter()
        for _ in range(args.block_steps):
            n = tr.state.step + 1
            tr.health.before_step(n, False)
            tr.step_once(measure=False)
            assert not tr.health.after_step(n)
        if block:
            times[on].append((time.perf_counter() - t_block) / args.block_steps)
    tr.health.close()
    tr.instruments.close()
    if mesh.is_main:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        pairs = statistics.median(a / b for a, b in zip(times[True], times[False], strict=False))
        per = statistics.median(in_check)
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq_len}, fp32, "
            f"2 gloo ranks (DDP), {args.blocks} blocks of {args.block_steps} steps\n"
            f"ms/step off {1e3 * off:.2f}, on (interval {args.interval}) {1e3 * on:.2f}; "
            f"ratio on/off: medians {on / off:.4f}, neighbouring pairs {pairs:.4f}\n"
            f"one check: {1e3 * per:.3f} ms ({len(in_check)} calls) = {per / args.interval / off:.3%} of a step at "
            f"interval {args.interval}",
            flush=True,
        )
    shutdown(True)


def clean_run(args: argparse.Namespace, precision: str) -> int:
    """The sdc events of a clean ``--clean-steps`` run checked every step (0 expected)."""
    d = Path(tempfile.mkdtemp()) / precision
    over = {
        **small_model(128, 2, 32), "train.global_batch_size": 4, "train.steps": args.clean_steps,
        "train.precision": precision, "train.eval_batches": 0, "train.device": "cpu", "metrics.log_interval": 100,
        "metrics.console": "false", "metrics.report": "false", "health.sdc_interval": 1, "run.dir": str(d),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2", *(f"--{k}={v}" for k, v in over.items())]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    events = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    return sum(e["event"] == "sdc" for e in events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--block-steps", type=int, default=10)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--clean-steps", type=int, default=1000)
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.run_dir = str(Path(tempfile.mkdtemp()) / "run")
    code = run_workers(__file__, args, 2)
    if code:
        sys.exit(code)
    if args.clean_steps:
        for precision in ("fp32", "bf16"):
            found = clean_run(args, precision)
            print(f"clean {precision} run, {args.clean_steps} steps checked every step: {found} sdc event(s)")


if __name__ == "__main__":
    main()
