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


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share), else
    the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity call on this OS)
        return os.cpu_count() or 1


def oversubscribed(device_type: str, ranks: int | None = None) -> bool:
    """More CPU ranks on this node (``ranks``, default the launcher's count) than cores: they take
    turns on the cores, so a rank's step time measures the sharing, not the rank."""
    return device_type == "cpu" and (ranks or local_world_size() or 1) > cpu_cores()


def restart_count() -> int:
    """How many times the elastic agent has restarted this group (0 on the first attempt)."""
    return max(0, _int("TORCHELASTIC_RESTART_COUNT", 0))


def attempt_scope() -> str:
    """A store-key scope that every rank of this attempt shares and no earlier attempt used.

    The agents' own store (torchrun's default) outlives an attempt, so keys are scoped by the
    restart count, which all agents share as long as none joined later. Where each round gets
    a fresh store hosted by rank 0 (``TORCHELASTIC_USE_AGENT_STORE=False``, e.g. under
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), restart counts differ between a surviving host
    and one that joined later (it starts at 0; pytorch/pytorch#135712), and the fresh store
    needs no such scope.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "false":
        return f"store-{os.environ.get('MASTER_PORT', '')}"
    return f"attempt-{restart_count()}"


def run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "run")


def under_launcher() -> bool:
    """Whether torchrun (or meshforge's own local launch) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
