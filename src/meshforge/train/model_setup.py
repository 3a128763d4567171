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
from meshforge.config import Config
from meshforge.errors import ConfigError
from meshforge.models.llama import build_model
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.shape import ModelShape
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.parallelize import parallelize, parallelize_pipeline
from meshforge.parallel.pipeline import Pipeline


@dataclass
class RankModel:
    args: ModelShape
    model: nn.Module  # the parameters this rank holds, under the whole model's names
    train_model: nn.Module  # what the step calls (model itself, or its DDP wrapper)
    pipeline: Pipeline | None  # pp > 1: the schedule over this rank's chunks


def build_rank_model(cfg: Config, mesh: Mesh, loss: LanguageModelLoss, args: ModelShape) -> RankModel:
    """This rank's part of the model (of shape ``args``, the launch's resolved ModelShape),
    parallelized, initialised from train.seed or model.init_from."""
    model = build_model(args, device="meta")
    pipeline = None
    if mesh.degrees["pp"] > 1:  # model: this rank's chunks, under the whole model's names
        model, pipeline = parallelize_pipeline(model, cfg, mesh, seed=cfg.train.seed, loss=loss)
        train_model = model
    else:
        train_model = parallelize(model, cfg, mesh, seed=cfg.train.seed)
    if cfg.model.init_from:
        load_init_from(model, args, cfg.model.init_from)
    return RankModel(args, model, train_model, pipeline)


def load_init_from(model: nn.Module, args: ModelShape, path: str) -> None:
    """Overwrite ``model``'s parameters with pretrained weights of the same shape."""
    pre = load_pretrained(path, device="cpu")
    diff = shape_mismatch(pre.args, args)
    if diff:
        raise ConfigError(f"model.init_from = {path} has another shape than [model]: " + "; ".join(diff))
    mine = dict(model.named_parameters())
    full = {k: v for k, v in pre.state_dict().items() if k in mine}  # a pipeline rank holds some
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
