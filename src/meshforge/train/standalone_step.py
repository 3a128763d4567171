"""A plain step runner built outside the Trainer, from the parts ``meshforge train`` builds it
from: calibration's probes, the GEMM census and benchmarks measure the step a run takes, not a
look-alike assembled by hand in each of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshforge.config.run_plan import RunPlan
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.parallelize import build_loss, build_rank_model, forward_context
from meshforge.train.moe_stats import install_step_hook
from meshforge.train.optimizer import build_optimizer, build_scheduler
from meshforge.train.step import PlainStep


@dataclass
class StandaloneStep:
    runner: PlainStep
    model: nn.Module
    optimizer: torch.optim.Optimizer


def standalone_step(plan: RunPlan, mesh: Mesh, step_hook: bool = False) -> StandaloneStep:
    """``step_hook``: the optimizer's post-step hook as the Trainer installs it (MoE balance
    bias, the step's loss parts) — for probes that time a whole step."""
    loss = build_loss(plan)
    built = build_rank_model(plan, mesh, loss)
    opt = build_optimizer(built.model, plan, mesh)
    if step_hook:
        install_step_hook(opt, built.model, loss, mesh)
    runner = PlainStep(
        plan=plan,
        mesh=mesh,
        model=built.model,
        optimizer=opt,
        scheduler=build_scheduler(opt, plan, 0),
        loss=loss,
        train_model=built.train_model,
        forward_context=forward_context(plan, mesh.device),
    )
    return StandaloneStep(runner, built.model, opt)
