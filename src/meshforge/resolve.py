"""A config made ready for a world size, once: presets and automatic values filled in, values
checked (``config.fill``), the layout checked by ``parallel/dims/``, and the automatic
layout values (inferred degrees, pipeline micro-batches) written back, so the run
directory's ``config.toml`` says exactly what ran.

``resolve`` is the one function the CLI, each rank and the planner's ``--config`` call; it
sits above ``config`` (schema) and ``parallel.dims`` (layout rules) and joins them.
``layout(cfg, world)`` and ``model_shape(cfg.model)`` read the resolved config's ``Layout``
and ``ModelShape``.
"""

from __future__ import annotations

import dataclasses

from meshforge import launch_env
from meshforge.config import Config, fill
from meshforge.layout import Layout, from_sections
from meshforge.models.presets import model_shape
from meshforge.parallel import dims
from meshforge.parallel.dims import Batch, DiLoCoRules


def layout(cfg: Config, world_size: int) -> Layout:
    """The config's layout for this world size (one -1 degree inferred; the degrees are one
    DiLoCo island's when diloco.islands > 1)."""
    return dims.resolve_degrees(from_sections(cfg.parallel, cfg.train, cfg.diloco), world_size)


def batch(cfg: Config, ranks_per_node: int | None = None, device: str | None = None) -> Batch:
    """What the layout rules read of a config besides the layout and the model."""
    d = cfg.diloco
    rules = DiLoCoRules(**{k: getattr(d, k) for k in DiLoCoRules.__dataclass_fields__})
    return Batch(cfg.train.seq_len, cfg.train.global_batch_size, ranks_per_node, device=device, diloco=rules)


def _device(cfg: Config) -> str:
    """The device type training will run on ("auto": CUDA when one is visible)."""
    if cfg.train.device != "auto":
        return cfg.train.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(cfg: Config, world_size: int = 1) -> Config:
    """Fill in presets and automatic values, then check values and the layout. Returns a new
    Config with the inferred degrees and pipeline micro-batches written in."""
    cfg = fill(cfg)
    lay = layout(cfg, world_size)
    settings = batch(cfg, launch_env.local_world_size(), _device(cfg))
    dims.check(lay, model_shape(cfg.model), settings)
    for k, v in lay.degrees().items():
        setattr(cfg.parallel, k, v)
    if lay.pp > 1 and not cfg.parallel.num_microbatches:
        cfg.parallel = dataclasses.replace(cfg.parallel, num_microbatches=lay.microbatches(settings.global_batch))
    return cfg
