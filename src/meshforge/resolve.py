"""A config made ready for a world size: presets and automatic values filled in, values
checked (``config.fill``), the layout checked by ``parallel/dims.py``, and the automatic
layout values (inferred degrees, pipeline micro-batches) written back, so the run
directory's ``config.toml`` says exactly what ran.

This is the one function the CLI, each rank and the planner's ``--config`` call; it sits
above ``config`` (schema) and ``parallel.dims`` (layout rules) and joins them.
"""

from __future__ import annotations

import dataclasses

from meshforge import launch_env
from meshforge.config import Config, fill
from meshforge.models.presets import model_args_from_config
from meshforge.parallel.dims import DiLoCoRules, ParallelDims, Training


def training_settings(cfg: Config, ranks_per_node: int | None = None) -> Training:
    """What the layout rules read of a config besides the degrees."""
    p, t = cfg.parallel, cfg.train
    return Training(
        seq_len=t.seq_len,
        global_batch=t.global_batch_size,
        micro_batch=t.micro_batch_size,
        zero_stage=p.zero_stage,
        sequence_parallel=p.sequence_parallel,
        pp_schedule=p.pp_schedule,
        pp_virtual_stages=p.pp_virtual_stages,
        num_microbatches=p.num_microbatches,
        pp_layers=tuple(p.pp_layers),
        ranks_per_node=ranks_per_node,
        qk_norm=bool(getattr(cfg.model, "qk_norm", False)),
        cp_balance=p.cp_balance,
        offload=p.offload,
        diloco=diloco_rules(cfg),
    )


def diloco_rules(cfg: Config) -> DiLoCoRules:
    """What the DiLoCo rules read of [diloco]."""
    d = cfg.diloco
    keys = ("islands", "inner_steps", "fragments", "delay", "sync_dtype", "outer_lr", "outer_momentum")
    return DiLoCoRules(**{k: getattr(d, k) for k in keys})


def layout(cfg: Config, world_size: int) -> ParallelDims:
    """The config's degrees for this world size (one -1 inferred)."""
    return ParallelDims.from_config(cfg.parallel, world_size, cfg.diloco.islands)


def resolve(cfg: Config, world_size: int = 1) -> Config:
    """Fill in presets and automatic values, then check values and the layout. Returns a new
    Config with the inferred degrees and pipeline micro-batches written in."""
    cfg = fill(cfg)
    dims = layout(cfg, world_size)
    settings = training_settings(cfg, launch_env.local_world_size())
    dims.check(model_args_from_config(cfg.model), settings)
    for k, v in dims.degrees().items():
        setattr(cfg.parallel, k, v)
    if dims.pp > 1 and not cfg.parallel.num_microbatches:
        cfg.parallel = dataclasses.replace(cfg.parallel, num_microbatches=dims.num_microbatches(settings))
    return cfg
