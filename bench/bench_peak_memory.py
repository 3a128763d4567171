"""A training step's peak memory against the planner's peak model, on a CPU (issue 51).

The debug shape widened to hidden 512 (4 blocks, one sequence per step, the chunked loss, eager:
the CPU defaults), fp32 and bf16 (autocast, the CPU's bf16), recomputation none / selective / full,
at each sequence length: one step of the run's own step runner in a fresh process
(calibration/peak_probe.py) under ``MemTracker`` (every live tensor's bytes), against the
planner's ``memory`` less its reserve (planner/peak_bytes.py: saved activations plus the largest
working set beside them). Then the growth from the first to the second length against the
process's resident high-water mark (VmHWM, a fresh process per point), with glibc's default
allocator and with its mmap threshold fixed (freed blocks returned to the system: the mark is
then the tensors' peak plus a constant).

    python bench/bench_peak_memory.py [--seqs 1024,2048,4096,8192] [--modes fp32:none,bf16:full]
"""

from __future__ import annotations

import argparse
import os
import time

from meshforge.calibration.peak_probe import measure_in_child, planned_peak, run_config

GIB, MIB = 2**30, 2**20
SHAPE = {"model.preset": "debug", "model.hidden": 512}
MODES = [f"{p}:{ac}" for p in ("fp32", "bf16") for ac in ("none", "selective", "full")]


def overrides(mode: str, seq: int) -> dict:
    precision, ac = mode.split(":")
    return {**SHAPE, "model.max_seq_len": max(seq, 1024), "train.seq_len": seq, "train.precision": precision,
            "train.activation_checkpoint": ac}  # fmt: skip


def planned_bytes(over: dict) -> tuple[float, float]:
    """The planner's allocated peak (its total less the reserve) and its activation + working part."""
    mem = planned_peak(run_config(over))
    return (mem["total"] - mem["reserve"]) * GIB, (mem["activations"] + mem["working"]) * GIB


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--growth", default="1024,4096", help="the two lengths of the resident-mark growth")
    a = ap.parse_args()
    seqs, modes = [int(s) for s in a.seqs.split(",")], a.modes.split(",")
    g0, g1 = (int(s) for s in a.growth.split(","))
    print(f"widened debug shape (hidden 512, 4 blocks), one sequence, chunked loss, eager; {load()}")
    print(f"{'mode':<15} {'seq':>6} {'MemTracker MiB':>14} {'planner MiB':>11} {'ratio':>6} {'s':>5}")
    worst = 0.0
    for mode in modes:
        for seq in seqs:
            start = time.time()
            over = overrides(mode, seq)
            got = measure_in_child(over)
            want, _ = planned_bytes(over)
            worst = max(worst, abs(want / got.tracker - 1))
            print(f"{mode:<15} {seq:>6} {got.tracker / MIB:>14.2f} {want / MIB:>11.2f} {want / got.tracker:>6.3f} "
                  f"{time.time() - start:>5.0f}")  # fmt: skip
    print(f"worst |planner / MemTracker - 1| = {worst:.4f}; {load()}")
    print(
        f"\ngrowth {g0} -> {g1} tokens (MiB): planner, MemTracker, resident mark (default malloc, fixed mmap threshold)"
    )
    for mode in modes:
        pts = {
            s: (measure_in_child(overrides(mode, s)), measure_in_child(overrides(mode, s), fixed_mmap=True))
            for s in (g0, g1)
        }
        planner = planned_bytes(overrides(mode, g1))[0] - planned_bytes(overrides(mode, g0))[0]
        tracker = pts[g1][0].tracker - pts[g0][0].tracker
        hwm, fixed = (pts[g1][i].hwm - pts[g0][i].hwm for i in (0, 1))
        print(f"{mode:<15} planner {planner / MIB:8.1f}  MemTracker {tracker / MIB:8.1f} ({planner / tracker:.3f})  "
              f"VmHWM {hwm / MIB:8.1f} ({planner / hwm:.3f})  VmHWM fixed mmap {fixed / MIB:8.1f} "
              f"({planner / fixed:.3f})")  # fmt: skip
    print(load())


if __name__ == "__main__":
    main()
