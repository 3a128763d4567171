"""torch.profiler traces of a few steps, one Chrome trace per rank in run.dir/profile/
(``rank-NNNNN.json``; open in Perfetto), and on GPUs a CUDA memory snapshot
(``rank-NNNNN-memory.pickle``; open at pytorch.org/memory_viz; not with profile.memory = false,
since recording each allocation's stack slows the traced steps' host side). Off unless
profile.steps > 0.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from meshforge.config.sections import ProfileConfig

DEFAULT_START = 3  # past the first steps' warm-up


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, rank: int, device: torch.device, run_dir: Path, total_steps: int):
        self.rank, self.device, self.dir = rank, device, run_dir / "profile"
        self.first = min(cfg.start_step or DEFAULT_START, total_steps)
        self.last = self.first + cfg.steps - 1
        self.enabled = cfg.steps > 0
        self.memory = cfg.memory and device.type == "cuda"
        self.prof: profile | None = None
        self.mark: record_function | None = None
        self.written: list[Path] = []

    def before(self, step: int) -> None:
        if self.enabled and step == self.first and self.prof is None:
            self._start()
        if self.prof is not None:
            self.mark = record_function(f"meshforge step {step}")  # each traced step as one span
            self.mark.__enter__()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)  # private API: wrapped here only
        self.prof = profile(activities=activities, record_shapes=True)
        with _native_stderr_quiet():
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is None:
            return
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends inside the traced steps)."""
        if self.prof is None:
            return
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        prof, self.prof, self.enabled = self.prof, None, False
        with _native_stderr_quiet():
            prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank-{self.rank:05d}.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)
        if self.memory:
            snap = self.dir / f"rank-{self.rank:05d}-memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snap)


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """Silence the profiler library's own lines on stderr (kineto prints ``USDT: ...
    profiler_start``/``profiler_stop`` from C++, with no setting to turn them off) while it
    starts and stops; nothing else of this process writes in that moment."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
