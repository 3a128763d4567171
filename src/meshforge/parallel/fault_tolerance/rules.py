"""What fault-tolerant replica groups need and what they compose with (pure Python, no torch).

Each replica group is one ``meshforge train`` with the ``[parallel]`` layout inside it; the groups
average gradients through torchft's manager after each group's own reduction, so anything inside a
group composes that leaves whole, ordinary gradients in the parameters before the optimizer steps:
DDP, ZeRO-1 (fp32), FSDP2 stages 2/3 and HSDP, tensor and pipeline parallelism. What reduces
gradients inside its own optimizer (bf16 ZeRO-1), keeps islands apart (DiLoCo), or moves one group
back alone (a health rollback) is refused by key, with the reason.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit

from meshforge.config.layout import Layout
from meshforge.parallel.rule_types import Problem


class FaultTolerance(Protocol):
    """What these rules read of ``[fault_tolerance]`` (config/sections.py's FaultToleranceConfig: the
    rules stay on the shared core's layout types and take the section by shape)."""

    enabled: bool
    lighthouse: str
    replica_id: int
    min_replicas: int


def problems(ft: FaultTolerance, lay: Layout, precision: str, rollbacks: list[str]) -> list[Problem]:
    """Every reason this fault-tolerance setting cannot run with this layout (empty: it can);
    ``rollbacks``: the ``health.on_*`` keys set to 'rollback'."""
    if not ft.enabled:
        if lay.replicas > 1:
            return [Problem("fault_tolerance.replicas", _off(lay.replicas))]
        return []
    out = _settings(ft, lay)
    if lay.islands > 1:
        why = "DiLoCo's islands drift apart between syncs, replica groups must not"
        out.append(_unsupported("diloco.islands", f"diloco.islands = {lay.islands} under fault tolerance: {why}"))
    if precision in ("bf16", "fp8") and lay.zero_stage == 1 and lay.dp_cp > 1:
        out.append(
            _unsupported(
                "parallel.zero_stage",
                f"parallel.zero_stage = 1 in {precision} under fault tolerance: bf16 ZeRO-1 reduces its gradients "
                "inside its optimizer, where the groups cannot average them; use zero_stage = 0, 2 or 3",
            )
        )
    for key in rollbacks:
        out.append(
            _unsupported(
                f"health.{key}",
                f"health.{key} = 'rollback' under fault tolerance: one group going back to its checkpoint alone "
                "would leave the others' step; use 'stop' (the group restarts and heals from a live peer) or "
                "'skip'/'log'",
            )
        )
    return out


def _off(replicas: int) -> str:
    return (
        f"fault_tolerance.replicas = {replicas} plans {replicas} replica groups, but fault_tolerance.enabled = false; "
        "set fault_tolerance.enabled = true (and fault_tolerance.lighthouse), or fault_tolerance.replicas = 1"
    )


def _settings(ft: FaultTolerance, lay: Layout) -> list[Problem]:
    out = []
    url = urlsplit(ft.lighthouse)
    if url.scheme != "http" or not url.hostname or _port(url) is None or url.path not in ("", "/"):
        out.append(
            Problem(
                "fault_tolerance.lighthouse",
                f"fault_tolerance.lighthouse = {ft.lighthouse!r} is not a lighthouse URL; give the http://HOST:PORT "
                "that `meshforge lighthouse --bind HOST:PORT` listens on",
            )
        )
    if ft.replica_id >= lay.replicas:
        out.append(
            Problem(
                "fault_tolerance.replica_id",
                f"fault_tolerance.replica_id = {ft.replica_id} is not below fault_tolerance.replicas = {lay.replicas}; "
                f"number the groups 0 .. {lay.replicas - 1} (or raise fault_tolerance.replicas)",
            )
        )
    if ft.min_replicas > lay.replicas:
        out.append(
            Problem(
                "fault_tolerance.min_replicas",
                f"fault_tolerance.min_replicas = {ft.min_replicas} is more than the fault_tolerance.replicas = "
                f"{lay.replicas} groups planned; no step could ever commit: lower it",
            )
        )
    return out


def _port(url) -> int | None:
    try:
        return url.port
    except ValueError:
        return None


def _unsupported(key: str, message: str) -> Problem:
    return Problem(key, message, "unsupported")
