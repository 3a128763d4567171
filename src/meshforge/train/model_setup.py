"""Build this rank's model for the configured layout, optionally from pretrained weights.

The model is created on the meta device, parallelized (which materialises only this
rank's shards, initialised from the seed), and then, with model.init_from, overwritten
by the full pretrained tensors (each rank keeps its own shards).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from meshforge.checkpoint.weights import load_pretrained, shape_mismatch
from meshforge.config.run_plan import RunPlan
from meshforge.errors import ConfigError
from meshforge.models.llama import build_model
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.shape import ModelShape
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.parallelize import parallelize, parallelize_pipeline
from meshforge.parallel.pipeline.runtime import Pipeline


@dataclass
class RankModel:
    model: nn.Module  # the parameters this rank holds, under the whole model's names
    train_model: nn.Module  # what the step calls (model itself, or its DDP wrapper)
    pipeline: Pipeline | None  # pp > 1: the schedule over this rank's chunks


def build_rank_model(plan: RunPlan, mesh: Mesh, loss: LanguageModelLoss) -> RankModel:
    """This rank's part of the plan's model, parallelized, initialised from train.seed or
    model.init_from."""
    model = build_model(plan.shape, device="meta")
    pipeline = None
    seed = plan.train.seed
    if plan.layout.pp > 1:  # model: this rank's chunks, under the whole model's names
        model, pipeline = parallelize_pipeline(model, plan, mesh, seed=seed, loss=loss)
        train_model = model
    else:
        train_model = parallelize(model, plan, mesh, seed=seed)
    if plan.model.init_from:
        load_init_from(model, plan.shape, plan.model.init_from)
    return RankModel(model, train_model, pipeline)


def load_init_from(model: nn.Module, shape: ModelShape, path: str) -> None:
    """Overwrite ``model``'s parameters with pretrained weights of the same shape."""
    pre = load_pretrained(path, device="cpu")
    diff = shape_mismatch(pre.shape, shape)
    if diff:
        raise ConfigError(f"model.init_from = {path} has another shape than [model]: " + "; ".join(diff))
    mine = dict(model.named_parameters())
    full = {k: v for k, v in pre.state_dict().items() if k in mine}  # a pipeline rank holds some
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
