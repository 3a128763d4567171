"""The one place that reads the launcher's environment (torchrun / torch.distributed.elastic,
or ``meshforge train --nproc N``, which starts ranks through the same launcher).

Everything below the CLI asks here instead of reading ``os.environ``, so what a rank
believes about its place in the job has one source.
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    return int(v) if v.strip().lstrip("-").isdigit() else default


def rank() -> int:
    return _int("RANK", 0)


def world_size() -> int:
    return _int("WORLD_SIZE", 1)


def local_rank() -> int:
    return _int("LOCAL_RANK", 0)


def local_world_size() -> int | None:
    """Ranks per node when a launcher says so (torchrun's LOCAL_WORLD_SIZE), else unknown."""
    v = _int("LOCAL_WORLD_SIZE", 0)
    return v or None


def restart_count() -> int:
    """How many times the elastic agent has restarted this group (0 on the first attempt)."""
    return max(0, _int("TORCHELASTIC_RESTART_COUNT", 0))


def run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "run")


def under_launcher() -> bool:
    """Whether torchrun (or meshforge's own local launch) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
