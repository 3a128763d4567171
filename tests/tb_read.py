"""Read TensorBoard event files back with tensorboard's own reader (EventAccumulator)."""

from pathlib import Path

import pytest


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar under ``path`` (an event file or its directory), by step then tag."""
    ea_mod = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard is not installed"
    )
    acc = ea_mod.EventAccumulator(str(path), size_guidance={ea_mod.SCALARS: 0})
    acc.Reload()
    out = [(e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    return sorted(out, key=lambda x: (x[0], x[1]))
