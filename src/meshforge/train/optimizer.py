"""AdamW with its parameter groups, and the learning-rate schedule as a LambdaLR.

The schedule (config/schedule.py) is linear warmup, then cosine / linear decay (or constant)
to a floor of optim.lr x optim.min_lr_ratio, reached at optim.decay_steps (default
train.steps), or warmup-stable-decay (wsd). ``lr_at`` gives it for a run plan; the scheduler
applies it with base LR 1.0, so the LR an optimizer step uses is exactly ``lr_at(plan, step)``.
After a checkpoint load the scheduler is built at the resumed step (the schedule is a pure
function of the step, so nothing else needs saving).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from meshforge.config.run_plan import RunPlan
from meshforge.config.schedule import lr_at as schedule_lr
from meshforge.parallel.data.apply import make_optimizer
from meshforge.parallel.mesh import Mesh


def lr_at(plan: RunPlan, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``plan``'s run."""
    return schedule_lr(plan.optim, plan.train.steps, step)


def build_optimizer(model: torch.nn.Module, plan: RunPlan, mesh: Mesh) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and embeddings (incl. a head tied to the embedding)."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
    o = plan.optim
    impl = o.implementation  # resolved: "auto" is fused (one kernel per step, CUDA and CPU)
    kw: dict[str, Any] = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw.update(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return make_optimizer(groups, torch.optim.AdamW, kw, mesh, plan.layout, plan.flat_zero1, plan.batch.count)


def build_scheduler(optimizer: torch.optim.Optimizer, plan: RunPlan, step: int = 0) -> LambdaLR:
    """The schedule, positioned so the next optimizer step (``step``, 0-based) uses ``lr_at(plan, step)``."""
    for g in optimizer.param_groups:
        g["initial_lr"] = 1.0  # the lambda returns the LR itself
    return LambdaLR(optimizer, lambda s: lr_at(plan, s), last_epoch=step - 1)


def current_lr(scheduler: LambdaLR) -> float:
    """The LR the next optimizer step uses (a Python float: no device sync)."""
    return scheduler.get_last_lr()[0]
