"""Fault injection, to test that a run survives what clusters do to it.

``MESHFORGE_FAULT="kill:rank=R:step=S"`` SIGKILLs rank R right after step S;
``MESHFORGE_FAULT="kill:rank=R:save=S"`` SIGKILLs it while the checkpoint of step S is
being written (its shards are on disk, the checkpoint is not complete). Faults fire only
on the first attempt (``launch_env.restart_count()`` = 0), so a restarted group runs clean.
Nothing happens when the variable is unset.
"""

from __future__ import annotations

import os
import signal

from meshforge import launch_env
from meshforge.errors import ConfigError


def _parse(spec: str) -> tuple[str, int, int] | None:
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "kill":
        raise ConfigError(f"MESHFORGE_FAULT = {spec!r}: expected kill:rank=R:step=S or kill:rank=R:save=S")
    try:
        rank = int(parts[1].removeprefix("rank="))
        point, value = parts[2].split("=")
        if point not in ("step", "save"):
            raise ValueError
        return point, rank, int(value)
    except ValueError:
        raise ConfigError(f"MESHFORGE_FAULT = {spec!r}: expected kill:rank=R:step=S or kill:rank=R:save=S") from None


def configured() -> tuple[str, int, int] | None:
    spec = os.environ.get("MESHFORGE_FAULT", "")
    if not spec or launch_env.restart_count() > 0:
        return None
    return _parse(spec)


def maybe_kill(point: str, rank: int, step: int) -> None:
    fault = configured()
    if fault is not None and fault == (point, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
