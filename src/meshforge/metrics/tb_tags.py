"""TensorBoard tags grouped by what they are about: ``train/`` (loss, LR, gradient norm,
validation), ``perf/`` (throughput, MFU, step time, time breakdown, communication, bubble),
``mem/`` (peak and state memory) and ``health/`` (health events). Nested figures (time
breakdown parts, state bytes, bytes per axis) become one tag each. The flat names of
earlier versions (``loss``, ``mfu``, ...) are written as well, so existing dashboards and
scripts keep working.
"""

from __future__ import annotations

from typing import Any

GROUPS = {
    "train": ("loss", "lr", "grad_norm", "val_loss", "val_ppl", "tokens_seen"),
    "mem": ("peak_mem_gib", "state_mem_gib", "state_mem_bytes", "pp_peak_mem_gib"),
}
HEALTH_VALUES = {"nonfinite": None, "loss_spike": "score", "straggler": "ratio", "hang": None}


def _group(key: str) -> str:
    return next((g for g, keys in GROUPS.items() if key in keys), "perf")


def grouped(rec: dict[str, Any]) -> dict[str, float]:
    """``rec``'s numbers as grouped tags plus the legacy flat ones (top-level numbers only)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[f"{_group(k)}/{k}"] = v
            out[k] = v  # legacy name
        elif isinstance(v, dict):
            for sub, x in v.items():
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    out[f"{_group(k)}/{k}/{sub}"] = x
    return out


def health_scalar(kind: str, fields: dict[str, Any]) -> dict[str, float]:
    """A health event as one scalar (its score or ratio, else 1) under ``health/``."""
    if kind not in HEALTH_VALUES:
        return {}
    key = HEALTH_VALUES[kind]
    value = fields.get(key, 1.0) if key else 1.0
    return {f"health/{kind}": float(value)} if isinstance(value, (int, float)) else {}
