"""Where metrics go: the console, ``metrics.jsonl``, ``events.jsonl`` and TensorBoard
(``torch.utils.tensorboard``, with the optional ``tensorboard`` package: without it, a
one-line note and no event files)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from meshforge.errors import MeshforgeError
from meshforge.metrics.pace import Pace
from meshforge.metrics.tb_tags import grouped, health_scalar
from meshforge.safeio.files import MAX_JSONL_BYTES, read_regular
from meshforge.safeio.links import open_append, write_new
from meshforge.safeio.parse import loads_json


def _fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s >= 2 * 365 * 86400:
        return f"{s / (365.25 * 86400):,.1f} years"
    s = int(s)
    if s >= 2 * 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _fmt_rate(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


TB_MISSING = (
    "note: metrics.tensorboard is on but the tensorboard package is not installed, so no TensorBoard "
    "files are written (pip install 'meshforge[tensorboard]', or set metrics.tensorboard = false)"
)


class TensorBoardWriter:
    """Scalars to ``log_dir`` through torch's ``SummaryWriter``, flushed on every logged step."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    @classmethod
    def open(cls, log_dir: Path, stream: TextIO) -> TensorBoardWriter | None:
        try:
            return cls(log_dir)
        except ImportError:
            print(TB_MISSING, file=stream, flush=True)
            return None

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class JsonlWriter:
    def __init__(self, path: Path):
        self._f = open_append(path)  # never through a link put in its place

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MetricsLogger:
    """Fans one record per logged step out to every enabled sink (rank 0 only)."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        console: bool = True,
        jsonl: bool = True,
        tensorboard: bool = True,
        stream: TextIO | None = None,
    ):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.console = console
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl") if jsonl else None
        self.events = JsonlWriter(run_dir / "events.jsonl")
        self.tb = TensorBoardWriter.open(run_dir / "tensorboard", self.stream) if tensorboard else None
        self.t0 = time.perf_counter()
        self.pace = Pace()  # wall-clock seconds per step between console lines, for the ETA
        self.last = (0, self.t0)  # (step, time) of the last console line
        self.sinks: list[Any] = []  # more scalar sinks (log(step, scalars), close()): W&B

    def add_sink(self, sink: Any) -> None:
        self.sinks.append(sink)

    def log_step(self, rec: dict[str, Any]) -> None:
        if self.metrics:
            self.metrics.write(rec)
        if self.tb:
            self.tb.add_scalars(rec["step"], grouped(rec))
        for sink in self.sinks:
            sink.log(rec["step"], grouped(rec))
        if self.console:
            step, now = rec["step"], time.perf_counter()
            self.pace.add(step - self.last[0], now - self.last[1])
            self.last = (step, now)
            eta = self.pace.eta(self.total - step)  # at the recent pace, not the average since the start
            width = 20
            done = int(width * step / self.total)
            bar = "#" * done + "." * (width - done)
            print(
                f"[{bar}] step {step:>{len(str(self.total))}}/{self.total} | loss {rec['loss']:.4f} | "
                f"lr {rec['lr']:.2e} | {_fmt_rate(rec['tokens_per_s'])} tok/s | MFU {100 * rec['mfu']:.1f}% | "
                f"ETA {_fmt_duration(eta)}",
                file=self.stream,
                flush=True,
            )

    def log_eval(self, step: int, loss: float) -> None:
        ppl = math.exp(min(loss, 50))
        rec = {"step": step, "val_loss": loss, "val_ppl": ppl}
        self.event("eval", **rec)
        if self.tb:
            self.tb.add_scalars(step, grouped({"val_loss": loss, "val_ppl": ppl}))
        for sink in self.sinks:
            sink.log(step, grouped({"val_loss": loss, "val_ppl": ppl}))
        if self.console:
            print(
                f"  eval @ step {step}: val loss {loss:.4f} | perplexity {ppl:.2f}",
                file=self.stream,
                flush=True,
            )

    def event(self, kind: str, **fields: Any) -> None:
        self.events.write({"time": time.time(), "event": kind, **fields})
        if self.tb and isinstance(fields.get("step"), int) and health_scalar(kind, fields):
            self.tb.add_scalars(fields["step"], health_scalar(kind, fields))

    def print(self, text: str) -> None:
        if self.console:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        for s in (self.metrics, self.events, self.tb, *self.sinks):
            if s:
                s.close()


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drop metrics.jsonl records after ``step`` (they are recomputed after a resume), so the
    file keeps one record per step. Returns how many were dropped."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in read_regular(path, MAX_JSONL_BYTES).decode("utf-8", errors="replace").splitlines():
        try:
            rec = loads_json(line, str(path))
        except MeshforgeError:  # a line cut short by the crash (or not a record at all)
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step", 0), (int, float)) and rec.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    write_new(path, "".join(x + "\n" for x in kept))
    return dropped
