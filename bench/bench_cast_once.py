"""bf16 weights cast once per micro-batch (train.mixed_precision = cast_once: FSDP2's
mixed-precision policy) against autocast (a cast at every use), side by side in one run.

Two trainers of the same small model in one process (world of one) or in the same 2 gloo
ranks (``--ranks 2``: DDP + autocast against FSDP2 replicated over dp), eager bf16 on CPU;
blocks of steps alternate between them. Printed: ms/step medians and their ratio, and from
torch.profiler over one unlogged step of each the dtype-cast calls per step
(aten::_to_copy, aten::copy_): the GPU-relevant evidence, since CPU bf16 matmul speed says
little about a GPU's (the H100 profile had element-wise kernels at 49% of an eager step).

    python bench/bench_cast_once.py [--ranks 2] [--blocks 10 --block-steps 5 --hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ranks import run_workers
from small_model import small_model

CASTS = ("aten::_to_copy", "aten::copy_", "aten::_foreach_copy_")


def trainer(args: argparse.Namespace, mode: str):
    from meshforge.config import load_config
    from meshforge.guards.preflight import follower_plan, preflight
    from meshforge.launch.env import rank, world_size
    from meshforge.parallel.mesh import build_mesh
    from meshforge.train.loop import Trainer, agree_on_start
    from meshforge.train.run_dir import prepare_run_dir

    over = {
        **small_model(args.hidden, args.layers, args.seq_len),
        "train.global_batch_size": args.batch * world_size(), "train.steps": 10**6, "train.device": "cpu",
        "train.precision": "bf16", "train.mixed_precision": mode, "train.eval_batches": 0,
        "metrics.console": False, "metrics.tensorboard": False, "metrics.log_interval": 10**6,
        "checkpoint.save_final": False, "run.dir": str(Path(args.run_dir) / mode), "health.hang_timeout_s": 0.0,
    }  # fmt: skip
    cfg = load_config(None, over)
    cfg = preflight(cfg, world_size()) if rank() == 0 else follower_plan(cfg, world_size())
    if rank() == 0:
        prepare_run_dir(cfg)
    mesh = build_mesh(cfg.layout, "cpu")
    cfg, _ = agree_on_start(cfg, mesh)
    return Trainer(cfg, mesh)


def casts_per_step(tr) -> dict[str, tuple[int, int]]:
    """(calls, elements) of the cast ops in one unlogged step (forward, backward, optimizer)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        tr.step_once(measure=False)
    out: dict[str, list[int]] = {k: [0, 0] for k in CASTS}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in CASTS:
            numel = _numel(e.input_shapes[0]) if e.input_shapes else 0  # (the source, or a list of them)
            out[e.key][0] += e.count
            out[e.key][1] += e.count * numel
    return {k: (v[0], v[1]) for k, v in out.items()}


def _numel(shape: list) -> int:
    if shape and isinstance(shape[0], list):
        return sum(_numel(s) for s in shape)
    return math.prod(shape)


def worker(args: argparse.Namespace) -> None:
    from meshforge.parallel.mesh import shutdown

    trainers = {m: trainer(args, m) for m in ("autocast", "cast_once")}
    times: dict[str, list[float]] = {m: [] for m in trainers}
    for block in range(2 * args.blocks + 2):
        mode = ("autocast", "cast_once")[block % 2]
        t0 = time.perf_counter()
        for _ in range(args.block_steps):
            trainers[mode].step_once(measure=False)
        if block >= 2:  # the first block of each: warm-up
            times[mode].append((time.perf_counter() - t0) / args.block_steps)
    casts = {m: casts_per_step(tr) for m, tr in trainers.items()}
    if trainers["autocast"].mesh.is_main:
        report(args, times, casts)
    shutdown(True)


def report(args: argparse.Namespace, times: dict, casts: dict) -> None:
    old, new = statistics.median(times["autocast"]), statistics.median(times["cast_once"])
    pairs = statistics.median(b / a for a, b in zip(times["autocast"], times["cast_once"], strict=False))
    world = "world of one" if args.ranks == 1 else f"{args.ranks} gloo ranks (DDP vs FSDP2 replicated over dp)"
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq_len} per rank, eager bf16, "
        f"{world}, {args.blocks} blocks of {args.block_steps} steps each, alternating\n"
        f"{'path':<10} {'ms/step':>9}   cast ops per step: calls (elements)\n"
        + "\n".join(
            f"{m:<10} {1e3 * statistics.median(times[m]):>9.1f}   "
            + ", ".join(f"{k.split('::')[1]} {n} ({e / 1e6:.2f}M)" for k, (n, e) in casts[m].items())
            for m in ("autocast", "cast_once")
        )
        + f"\nratio cast_once/autocast: medians {new / old:.3f}, neighbouring blocks {pairs:.3f} (under load)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.run_dir = args.run_dir or tempfile.mkdtemp()
    sys.exit(run_workers(__file__, args, args.ranks))


if __name__ == "__main__":
    main()
