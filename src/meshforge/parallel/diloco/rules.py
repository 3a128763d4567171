"""DiLoCo: islands that sync every H inner steps, in fragments, with a delay."""

from __future__ import annotations

from collections.abc import Iterator

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.rule_types import SYNC_DTYPES, Batch, Problem


def diloco_problems(d: Layout, model: ModelShape, t: Batch) -> Iterator[Problem]:
    """DiLoCo (islands > 1): a round of H inner steps, F fragments synced H / F steps apart,
    each applied ``delay`` steps after its send (so at most one sync per fragment is in flight)."""
    c = t.diloco
    if c is None or d.islands == 1:
        return
    h, f, tau = c.inner_steps, c.fragments, c.delay
    checks = (
        (h >= 1, "diloco.inner_steps", f"diloco.inner_steps = {h} must be >= 1 (e.g. 50)"),
        (c.outer_lr > 0, "diloco.outer_lr", f"diloco.outer_lr = {c.outer_lr} must be > 0 (the paper: 0.7)"),
        (
            0 <= c.outer_momentum < 1,
            "diloco.outer_momentum",
            f"diloco.outer_momentum = {c.outer_momentum} must be in [0, 1) (the paper: 0.9)",
        ),
        (
            c.sync_dtype in SYNC_DTYPES,
            "diloco.sync_dtype",
            f"diloco.sync_dtype = {c.sync_dtype!r} is not one of {', '.join(SYNC_DTYPES)}",
        ),
        (
            1 <= f <= model.layers,
            "diloco.fragments",
            f"diloco.fragments = {f} must be between 1 and model.layers = {model.layers} (a fragment is a "
            "contiguous group of blocks); lower diloco.fragments",
        ),
        (
            c.warmup_steps >= 0,
            "diloco.warmup_steps",
            f"diloco.warmup_steps = {c.warmup_steps} must be >= 0 (0: the first round starts at step 1)",
        ),
    )
    for ok, key, message in checks:
        if not ok:
            yield Problem(key, message)
    if h < 1 or not 1 <= f <= model.layers:
        return
    if h % f:
        yield Problem(
            "diloco.inner_steps",
            f"diloco.inner_steps = {h} must be a multiple of diloco.fragments = {f} (fragments sync every "
            f"inner_steps / fragments steps); use e.g. diloco.inner_steps = {-(-h // f) * f}",
        )
    elif not 0 <= tau < h // f:
        yield Problem(
            "diloco.delay",
            f"diloco.delay = {tau} must be in [0, inner_steps / fragments = {h // f}) (a fragment's sync must land "
            f"before the next one is sent); lower diloco.delay to at most {h // f - 1} or raise diloco.inner_steps",
        )
