"""Checkpoint overhead: tokens/s with no checkpoints, synchronous ones and background
(async) ones every N steps, and the time each save blocks training, in one run.

Three trainers on the same model and data (one process) take turns in blocks of N steps;
each block starts with a save (except for "none"), so machine noise hits all three alike.
A save's blocking time is how long training waits: the whole write when synchronous; the
copy to host memory, plus any wait for the write to finish if it outlasts the N steps
after it, when async. Target (issue 6):
async blocking overhead <= 5% of training time at an interval where one synchronous save
takes about one step's time (CheckFreq reports ~3.5%).

    python bench/bench_checkpoint.py                  # hidden 512, 4 layers, N = 4
    python bench/bench_checkpoint.py --every 10 --blocks 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

MODES = ("none", "sync", "async")


def build(args: argparse.Namespace) -> tuple[dict, dict, int]:
    """One trainer per mode (no checkpoints, synchronous, asynchronous saves every N steps),
    and per mode the list its saves' write times go to."""
    from meshforge.config import load_config
    from meshforge.guards.preflight import preflight
    from meshforge.models.flops import num_params
    from meshforge.parallel.mesh import build_mesh
    from meshforge.train import Trainer, prepare_run_dir

    tmp = tempfile.mkdtemp()
    base = {
        "model.hidden": args.hidden, "model.layers": args.layers, "model.heads": args.hidden // 64,
        "model.kv_heads": 2, "model.ffn_hidden": args.hidden * 3, "train.seq_len": args.seq_len,
        "train.global_batch_size": args.batch, "train.steps": 10**6, "train.precision": "fp32",
        "train.device": "cpu", "optim.warmup_steps": 0, "checkpoint.keep": 2, "metrics.console": False,
        "metrics.jsonl": False, "metrics.tensorboard": False,
    }  # fmt: skip
    modes = {"none": (0, False), "sync": (args.every, False), "async": (args.every, True)}
    trainers, saves = {}, {}
    for name, (interval, background) in modes.items():
        o = {**base, "checkpoint.interval": interval, "checkpoint.async": background, "run.dir": f"{tmp}/{name}"}
        cfg = preflight(load_config(None, o), 1)
        prepare_run_dir(cfg)
        tr = Trainer(cfg, build_mesh(cfg.layout, cfg.train.device))
        saves[name] = []
        tr.checkpoints.checkpointer.event = lambda event, _name=name, **f: saves[_name].append(f)  # total write times
        trainers[name] = tr
    return trainers, saves, num_params(trainers["none"].plan.shape)


def run_blocks(args: argparse.Namespace, trainers: dict) -> tuple[dict, dict, dict, list[float]]:
    """Blocks of save + N steps per mode, modes taking turns; (blocking, elapsed, steps, step times)."""
    blocking: dict[str, list[float]] = {m: [] for m in MODES}
    elapsed: dict[str, float] = dict.fromkeys(MODES, 0.0)
    steps: dict[str, int] = dict.fromkeys(MODES, 0)
    step_times: list[float] = []
    for tr in trainers.values():
        tr.step_once()
    for _ in range(args.blocks):
        for name, tr in trainers.items():
            # a block is: save (not for "none"), N steps, then wait for a background write to
            # finish -- so an async write overlaps its own trainer's steps, never another's
            t0 = time.perf_counter()
            if name != "none":
                b0 = time.perf_counter()
                tr.checkpoints.save()
                blocking[name].append(time.perf_counter() - b0)
            for _ in range(args.every):
                s0 = time.perf_counter()
                tr.step_once()
                if name == "none":
                    step_times.append(time.perf_counter() - s0)
                tr.checkpoints.checkpointer.poll()
            w0 = time.perf_counter()
            tr.checkpoints.checkpointer.wait()  # only blocks if the write outlasted N steps
            if name == "async":
                blocking[name][-1] += time.perf_counter() - w0
            elapsed[name] += time.perf_counter() - t0
            steps[name] += args.every
    for tr in trainers.values():
        tr.checkpoints.checkpointer.close()
    return blocking, elapsed, steps, step_times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints (N)")
    p.add_argument("--blocks", type=int, default=5)
    args = p.parse_args()
    trainers, saves, psi = build(args)
    blocking, elapsed, steps, step_times = run_blocks(args, trainers)
    tokens = args.batch * args.seq_len
    step = statistics.median(step_times)
    print(
        f"model: {psi / 1e6:.2f}M parameters; state per save {16 * psi / 1e6:.0f} MB (fp32 params + Adam m, v); "
        f"batch {args.batch} x {args.seq_len}; a save every {args.every} steps; {args.blocks} blocks; 1 process"
    )
    print(f"median step without checkpoints: {step:.3f} s\n")
    print(
        f"{'mode':<6} {'tokens/s':>9} {'vs none':>8} {'blocking/save (s)':>18} {'write/save (s)':>15} {'overhead':>9}"
    )
    base_tps = steps["none"] * tokens / elapsed["none"]
    for name in MODES:
        tps = steps[name] * tokens / elapsed[name]
        blk = statistics.median(blocking[name]) if blocking[name] else 0.0
        wrote = statistics.median(s["total_s"] for s in saves[name]) if saves[name] else 0.0
        over = sum(blocking[name]) / elapsed[name]
        print(f"{name:<6} {tps:>9.0f} {tps / base_tps:>7.3f}x {blk:>18.3f} {wrote:>15.3f} {100 * over:>8.2f}%")
    sync_save = statistics.median(blocking["sync"])
    print(
        f"\none synchronous save = {sync_save / step:.2f} steps; overhead = time blocked in saves / training time. "
        "Async writes compete with training for this machine's 2 cores, which 'tokens/s vs none' includes."
    )


if __name__ == "__main__":
    main()
