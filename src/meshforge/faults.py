"""Fault injection, to test that a run survives (or names) what clusters do to it.

``MESHFORGE_FAULT`` holds one fault, or several of different kinds separated by commas:

- ``kill:rank=R:step=S`` SIGKILLs rank R right after step S; ``kill:rank=R:save=S`` while
  the checkpoint of step S is being written (its shards on disk, the checkpoint incomplete);
- ``nan:rank=R:step=S`` turns rank R's forward output non-finite at step S: its loss, and
  through backward and the gradient reduction every rank's gradients (an overflow's path);
- ``spike:step=S`` multiplies step S's loss, as every rank sees and logs it, by 20;
- ``hang:rank=R:step=S`` makes rank R stop before step S's work and never come back;
- ``slow:rank=R:factor=F`` makes rank R's forward passes F times as slow (every step);
- ``pace:ms=M`` makes every rank sleep M ms after each step, on every attempt (a test whose
  run must outlast what it does to the run: hosts killed and started again).

Faults other than pace fire only on the first attempt (``launch_env.restart_count()`` = 0), so a restarted
group runs clean, and nan / spike only once (a step redone after a rollback runs clean).
Nothing happens when the variable is unset.
"""

from __future__ import annotations

import functools
import os
import signal
import time

from meshforge import launch_env
from meshforge.errors import ConfigError

# kind -> the fields it takes, in order
KINDS = {"kill": ("rank", "step|save"), "nan": ("rank", "step"), "spike": ("step",), "hang": ("rank", "step")}
KINDS["slow"] = ("rank", "factor")
KINDS["pace"] = ("ms",)
SPIKE_FACTOR = 20.0
USAGE = (
    "expected one of kill:rank=R:step=S, kill:rank=R:save=S, nan:rank=R:step=S, spike:step=S, "
    "hang:rank=R:step=S, slow:rank=R:factor=F, pace:ms=M"
)


def parse(spec: str) -> tuple[str, dict[str, float]]:
    """``kind:key=value:...`` as (kind, {key: number}); refuses anything else, naming the forms."""
    kind, *parts = spec.split(":")
    if kind not in KINDS or len(parts) != len(KINDS[kind]):
        raise ConfigError(f"MESHFORGE_FAULT = {spec!r}: {USAGE}")
    fields: dict[str, float] = {}
    try:
        for part, allowed in zip(parts, KINDS[kind], strict=True):
            key, value = part.split("=")
            if key not in allowed.split("|"):
                raise ValueError
            fields[key] = float(value) if key == "factor" else int(value)
    except ValueError:
        raise ConfigError(f"MESHFORGE_FAULT = {spec!r}: {USAGE}") from None
    return kind, fields


def active(kind: str) -> dict[str, float] | None:
    """The fields of the configured fault of ``kind`` (on the first attempt only), else None."""
    spec = os.environ.get("MESHFORGE_FAULT", "")
    if not spec or launch_env.restart_count() > 0:
        return None
    for one in spec.split(","):
        got, fields = parse(one)
        if got == kind:
            return fields
    return None


def configured() -> tuple[str, int, int] | None:
    """A kill fault as (point, rank, step), for the kill points."""
    f = active("kill")
    if f is None:
        return None
    point = "save" if "save" in f else "step"
    return point, int(f["rank"]), int(f[point])


def maybe_kill(point: str, rank: int, step: int) -> None:
    fault = configured()
    if fault is not None and fault == (point, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


_fired: set[str] = set()  # a step redone after a rollback runs clean


def _once(kind: str, hit: bool) -> bool:
    if not hit or kind in _fired:
        return False
    _fired.add(kind)
    return True


def nan_now(rank: int, step: int) -> bool:
    f = active("nan")
    return _once("nan", f is not None and (f["rank"], f["step"]) == (rank, step))


def spike_now(step: int) -> bool:
    f = active("spike")
    return _once("spike", f is not None and f["step"] == step)


def maybe_hang(rank: int, step: int) -> None:
    """Never return when rank ``rank`` is about to run step ``step`` (the watchdog ends it)."""
    f = active("hang")
    if f is not None and (f["rank"], f["step"]) == (rank, step):
        while True:
            time.sleep(3600)


def slow_factor(rank: int) -> float:
    """How much slower this rank's forward passes are made (1.0: not at all)."""
    f = active("slow")
    return float(f["factor"]) if f is not None and f["rank"] == rank else 1.0


@functools.cache
def _pace_s(spec: str) -> float:
    for one in spec.split(","):
        if one.startswith("pace:"):
            return parse(one)[1]["ms"] / 1000
    return 0.0


def pace() -> None:
    """Sleep after a step when ``pace:ms=M`` is configured (on every attempt, every rank)."""
    s = _pace_s(os.environ.get("MESHFORGE_FAULT", ""))
    if s:
        time.sleep(s)
