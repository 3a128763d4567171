"""Mixture-of-experts bookkeeping of a run: the per-step hook (balance bias update, the
step's loss parts) and the figures of a logged step (auxiliary losses, expert load,
dropped tokens, expert-parallel all-to-all bytes against the formula).

The hook runs after every optimizer step and costs device adds only, plus -- when a layer
balances by bias, which needs the global load every step -- one all-reduce of E numbers
per MoE layer. Everything else (reductions over the ranks, reading values) happens only
on logged steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config.layout import Layout
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.moe import end_step, is_moe_layer, moe_layers
from meshforge.parallel.expert.dispatch import a2a_bytes_formula
from meshforge.parallel.mesh import Mesh


def data_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """The ranks that hold the same layers and see other tokens (whose loads add up): the loss
    group, None where it is this rank alone."""
    group = mesh.loss_group
    return group if group is not None and dist.get_world_size(group) > 1 else None


def install_step_hook(optimizer: torch.optim.Optimizer, model: nn.Module, loss: LanguageModelLoss, mesh: Mesh) -> None:
    """After each optimizer step: close the step's loss parts and (MoE models) its expert
    load, moving the balance bias."""
    group = data_group(mesh)
    has_moe = bool(moe_layers(model))

    def sum_over_ranks(loads: torch.Tensor) -> None:
        dist.all_reduce(loads, group=group)

    def hook(*_: Any) -> None:
        loss.end_step()
        if has_moe:
            end_step(model, sum_over_ranks if group is not None else None)

    optimizer.register_step_post_hook(hook)


def moe_record(
    model: nn.Module,
    loss: LanguageModelLoss,
    mesh: Mesh,
    lay: Layout,
    reduce_loss: Any,
    args: Any,
    tokens_per_rank: int,
) -> dict[str, Any]:
    """A logged step's MoE figures (a collective over the data-parallel ranks: every rank calls it).

    ``reduce_loss``: the step runner's reduction of per-rank loss values to the global batch's;
    ``tokens_per_rank``: the tokens one rank routes per step (for the all-to-all formula)."""
    if not getattr(args, "num_experts", 0):
        return {}
    names = ["lm_loss", "aux_loss", "z_loss"]
    parts = torch.stack([loss.step_terms.get(n, torch.zeros((), device=mesh.device)).float() for n in names])
    out: dict[str, Any] = dict(zip(names, reduce_loss(parts).tolist(), strict=True))
    out.update(expert_load(model, mesh, lay.pp))
    elem = next((m.dispatcher.elem_bytes for m in moe_layers(model).values() if hasattr(m.dispatcher, "elem_bytes")), 0)
    if lay.ep > 1 and elem:  # compare with comm_bytes["ep"] (this rank's; their mean over ep ranks matches)
        tokens = tokens_per_rank // lay.tp  # under tp each tp rank dispatches its share of the slots
        every = sum(1 for i in range(args.layers) if is_moe_layer(args, i))
        mine = len(moe_layers(model))  # a pipeline stage holds some of the layers
        out["ep_a2a_bytes_formula"] = a2a_bytes_formula(args, tokens, elem, lay.ep) * mine / every
    return out


def expert_load(model: nn.Module, mesh: Mesh, pp: int) -> dict[str, Any]:
    """Per MoE layer: max/mean tokens per expert, their coefficient of variation and the
    dropped fraction, over the whole global batch of the last step. Under pp each stage
    computes its own layers' and rank 0 gathers them (the others return their own)."""
    rows, drops = _stage_load(model, mesh)
    if pp > 1:
        rows, drops = _gather_stages(rows, drops, mesh)
    if not rows:
        return {}
    return {
        "expert_load": rows,
        "expert_load_max_mean": max(r["max_mean"] for r in rows.values()),
        "dropped_fraction": drops[0] / max(drops[1], 1.0),
    }


def _stage_load(model: nn.Module, mesh: Mesh) -> tuple[dict[str, dict[str, float]], list[float]]:
    """This rank's MoE layers' load figures (summed over the data-parallel ranks), and the
    dropped and routed slot totals over those layers."""
    layers = {k: m for k, m in moe_layers(model).items() if m.step_load is not None}
    if not layers:
        return {}, [0.0, 0.0]
    loads = torch.stack([m.step_load for m in layers.values()]).float()
    drops = torch.stack([m.step_drops for m in layers.values()]).float()
    group = data_group(mesh)
    if group is not None:
        local = torch.tensor([not m.step_load_global for m in layers.values()], device=loads.device)
        summed = loads.clone()
        dist.all_reduce(summed, group=group)
        loads = torch.where(local[:, None], summed, loads)
        dist.all_reduce(drops, group=group)
    mean = loads.mean(1).clamp_min(1e-12)
    ratio, cv = (loads.max(1).values / mean).tolist(), (loads.std(1, correction=0) / mean).tolist()
    dropped = (drops[:, 0] / drops[:, 1].clamp_min(1)).tolist()
    rows = {k: {"max_mean": ratio[i], "cv": cv[i], "dropped": dropped[i]} for i, k in enumerate(layers)}
    return rows, drops.sum(0).tolist()


def _gather_stages(
    rows: dict[str, dict[str, float]], drops: list[float], mesh: Mesh
) -> tuple[dict[str, dict[str, float]], list[float]]:
    """Every pipeline stage's layer figures on pp rank 0 (a collective over the pp group)."""
    group = mesh.group("pp")
    first = mesh.coordinate("pp") == 0
    every: list[Any] | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object((rows, drops), every, dst=dist.get_global_rank(group, 0), group=group)
    if not first or every is None:
        return rows, drops
    merged = {k: v for stage_rows, _ in every for k, v in stage_rows.items()}
    totals = [sum(d[i] for _, d in every) for i in range(2)]
    return {k: merged[k] for k in sorted(merged, key=int)}, totals
