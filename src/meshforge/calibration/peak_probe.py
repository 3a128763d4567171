"""A training step's peak memory on a CPU, measured two ways, for the planner's peak model
(planner/peak_bytes.py) to be held against.

The run's own step is built on a world of one as ``meshforge train`` builds it (model setup,
loss, optimizer, LR schedule, ``train/step.py``'s plain step runner), a step on a few tokens
creates the optimizer's state, and one step at the run's length is measured:

- ``torch.distributed._tools.mem_tracker.MemTracker``: every live tensor's bytes by kind
  (parameters, gradients, optimizer state, activations, temporaries), their sum at its peak;
- the process's resident high-water mark (``VmHWM`` in /proc/self/status, else
  ``ru_maxrss``). Read in a fresh process per point (``python -m meshforge.calibration.peak_probe``),
  so that one point's peak is not another's; what a process holds besides tensors (Python,
  torch, libraries) cancels in the growth between two lengths. glibc's malloc keeps freed heap
  memory for reuse (its mmap threshold rises to the largest block freed, up to 32 MiB), so the
  high-water mark also holds fragmentation; ``MALLOC_MMAP_THRESHOLD_`` fixed in the child's
  environment (``fixed_mmap``) returns every large block when freed, and the mark is then the
  tensors' own peak plus a constant: the check that MemTracker misses nothing a kernel allocates.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MMAP_THRESHOLD = 64 * 1024  # bytes: blocks from this size on are mapped (and unmapped when freed)


@dataclass
class StepPeak:
    """One measured step: MemTracker's peak (bytes, and by kind at that moment) and the process's
    resident high-water mark (bytes) after it."""

    tracker: int
    by_kind: dict[str, int]
    hwm: int


def _runner(plan: Any) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """train/step.py's plain step runner over ``plan``'s model on a world of one."""
    from meshforge.parallel.mesh import Mesh
    from meshforge.train.standalone_step import standalone_step

    step = standalone_step(plan, Mesh(0, 1, 0, torch.device("cpu"), plan.layout))
    return step.runner, step.model, step.optimizer


def high_water_mark() -> int:
    """This process's resident high-water mark in bytes (VmHWM; ru_maxrss where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_step(plan: Any) -> StepPeak:
    """One step of ``plan`` (one micro-batch, a world of one) under MemTracker, the optimizer's
    state created first (an update with zero gradients)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    runner, model, opt = _runner(plan)
    vocab, seq, mb = plan.shape.vocab_size, plan.train.seq_len, plan.layout.micro_batch_size
    for p in model.parameters():  # the optimizer's state, as after a first step (without its cost)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = torch.randint(0, vocab, (mb, seq + 1), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        runner.run(batch, measure=False)
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    kinds = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return StepPeak(kinds.pop("Total"), kinds, high_water_mark())


def run_config(overrides: dict[str, Any]) -> Any:
    """The world-of-one run plan of ``overrides`` (config keys) on a CPU, one sequence per step."""
    from meshforge.config import load_config
    from meshforge.resolve import resolve

    base = {"train.global_batch_size": 1, "train.micro_batch_size": 1, "train.device": "cpu", "train.seed": 0}
    return resolve(load_config(None, {**base, **overrides}), 1)


def measure_in_child(overrides: dict[str, Any], fixed_mmap: bool = False, timeout: float = 900) -> StepPeak:
    """``measure_step`` in a fresh process (its own high-water mark); ``fixed_mmap``: glibc's mmap
    threshold fixed at ``MMAP_THRESHOLD`` there (freed blocks go back to the system)."""
    env = dict(os.environ)
    if fixed_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    cmd = [sys.executable, "-m", "meshforge.calibration.peak_probe", json.dumps(overrides)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"peak probe failed ({out.returncode}): {out.stderr[-2000:]}")
    return StepPeak(**json.loads(out.stdout.strip().splitlines()[-1]))


def planned_peak(plan: Any) -> dict[str, float]:
    """The planner's memory breakdown (GiB) for ``plan``'s run on this CPU, as ``plan --config`` gives it."""
    from meshforge.planner.hardware import get_hardware
    from meshforge.planner.memory import memory

    t = plan.train
    mixed = t.mixed_precision if t.mixed_precision != "auto" else "autocast"
    hw = get_hardware("cpu")
    return memory(
        plan.shape,
        plan.layout,
        t.seq_len,
        t.precision,
        hw,
        compiled=t.compile,
        loss_chunk_size=t.loss_chunk_size,
        mixed=mixed,
    )


if __name__ == "__main__":
    print(json.dumps(asdict(measure_step(run_config(json.loads(sys.argv[1]))))))
