"""The rules' vocabulary: a ``Problem`` (a rule's answer) and what the rules read besides the layout and the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYNC_DTYPES = ("fp32", "bf16", "fp8")  # DiLoCo pseudo-gradients on the wire


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    kind: str = "invalid"  # "invalid" | "unsupported"


@dataclass(frozen=True)
class Batch:
    """What the rules read besides the layout and the model: the batch and the node size."""

    seq_len: int
    global_batch: int
    ranks_per_node: int | None = None
    device: str | None = None  # "cuda" / "cpu" where training runs; None: not known (the planner)
    precision: str | None = None  # train.precision once resolved; None: not known (the planner)
    compile: bool | None = None  # train.compile; None: not known
    diloco: DiLoCoRules | None = None  # [diloco] when diloco.islands > 1 (the islands are a Layout field)


@dataclass(frozen=True)
class DiLoCoRules:
    """What the DiLoCo rules read of the [diloco] section besides ``Layout.islands``."""

    inner_steps: int = 50
    fragments: int = 1
    delay: int = 0
    sync_dtype: str = "fp32"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    warmup_steps: int = 0


def product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out
