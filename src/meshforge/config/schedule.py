"""The learning-rate schedule as a pure function of [optim] and ``train.steps``.

Linear warmup to ``optim.lr``, then cosine / linear decay (or constant) to ``lr × min_lr_ratio``,
or warmup-stable-decay (``wsd``): the peak held until the last ``optim.decay_fraction`` of the
run, then a linear decay to the floor. Under wsd the steps before the decay do not depend on
where the run ends, so a run extended to more steps continues from its stable phase's end
(the checkpoint kept there) and is the run that was meant to be that long from the start.

Here rather than in train/ because more than the optimizer reads it: the resume point
(checkpoint/resume_point.py: which checkpoint an extended wsd run continues from), the
checkpoint's meta.json (the schedule its steps followed) and the run's last line (the LR a
fine-tune from the final weights starts at).
"""

from __future__ import annotations

import math
from typing import Any

from meshforge.config.sections import OptimConfig


def decay_start(optim: OptimConfig, steps: int) -> int:
    """The 0-based step at which the decay begins (every earlier step is warmup or stable):
    wsd, the last ``decay_fraction`` of ``steps`` (never inside the warmup); cosine and linear,
    the warmup's end; constant, never (``steps``)."""
    if optim.schedule == "wsd":
        length = max(1, round(optim.decay_fraction * steps))
        return min(steps, max(optim.warmup_steps, steps - length))
    if optim.schedule == "constant":
        return steps
    return optim.warmup_steps


def lr_at(optim: OptimConfig, steps: int, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) in a run of ``steps`` steps."""
    o = optim
    peak, floor = o.lr, o.lr * o.min_lr_ratio
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return peak
    if o.schedule == "wsd":
        start = decay_start(o, steps)
        if step < start:
            return peak
        return peak - (peak - floor) * min(1.0, (step - start + 1) / max(1, steps - start))
    end = o.decay_steps or steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, end - o.warmup_steps))
    if o.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_record(optim: OptimConfig, steps: int, step: int) -> dict[str, Any]:
    """What a checkpoint at ``step`` records of the schedule its steps followed (meta.json's
    ``lr_schedule``): a later run reads it to know where that run's decay began and which
    learning rate its next step would have taken."""
    return {
        "schedule": optim.schedule,
        "steps": steps,
        "decay_start": decay_start(optim, steps),
        "next_lr": lr_at(optim, steps, step),
    }
