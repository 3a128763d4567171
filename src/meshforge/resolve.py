"""A config resolved once against its world into the ``RunPlan`` every part reads.

``resolve`` fills every automatic value (device, precision, mixed-precision mode, the
vocabulary from the tokenizer, the inferred degree, pipeline micro-batches, micro-batch size,
expert-parallel chunks, warm-up, optimizer kernel, checkpoint cadence), checks the layout with
``parallel/rules.py`` and what only the machine decides (a GPU to offload from, torchao for
fp8), and takes each layout decision once. A
value it must change (a warm-up longer than the run, a chunked loss a zero-bubble schedule
cannot take on this torch) is a recorded ``Change`` with its reason, never a silent one.
"""

from __future__ import annotations

import copy
import dataclasses

from meshforge.config import Config
from meshforge.config.layout import Layout
from meshforge.config.run_plan import Change, RunPlan, World
from meshforge.config.sections import CheckpointConfig, OptimConfig, TrainConfig
from meshforge.data.tokenizer import load_tokenizer
from meshforge.errors import ConfigError
from meshforge.launch import env as launch_env
from meshforge.parallel import rules
from meshforge.parallel.fault_tolerance import rules as ft_rules
from meshforge.parallel.pipeline.schedules import SPLIT_BACKWARD, schedule_name
from meshforge.parallel.rules import Batch, DiLoCoRules

VOCAB_MULTIPLE = 64  # model.vocab_size = "auto" rounds a tokenizer's vocabulary up to this


def detect_world(cfg: Config, size: int | None = None, ranks_per_node: int | None = None) -> World:
    """This machine as a run of ``size`` ranks (default: the launcher's world), ``ranks_per_node``
    of them on each node (default: as the launcher's environment says), sees it."""
    import torch

    from meshforge.compat import split_backward_through_custom_functions, symm_mem_available

    size = launch_env.world_size() if size is None else size
    want = cfg.train.device
    cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    fp8 = cuda and cfg.train.precision == "fp8" and torch.cuda.is_available()
    fp8 = fp8 and torch.cuda.get_device_capability(launch_env.local_rank() % torch.cuda.device_count()) >= (8, 9)
    tok = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer != "byte" else None
    return World(
        size=size,
        device="cuda" if cuda else "cpu",
        ranks_per_node=launch_env.local_world_size() if ranks_per_node is None else ranks_per_node,
        torch=torch.__version__,
        fp8_native=bool(fp8),
        split_backward_custom_functions=split_backward_through_custom_functions(),
        symm_mem=cuda and cfg.layout.async_tp and symm_mem_available(),
        tokenizer_vocab=tok.vocab_size if tok is not None else None,
    )


def resolve(
    cfg: Config,
    world_size: int | None = None,
    *,
    world: World | None = None,
    machine: bool = True,
    ranks_per_node: int | None = None,
) -> RunPlan:
    """The run plan of ``cfg`` on ``world`` (default: this machine as ``world_size`` ranks,
    ``ranks_per_node`` per node: ``detect_world``); ``machine = False`` leaves out what only the
    machine refuses (``--dry-run`` says it instead)."""
    world = world or detect_world(cfg, world_size, ranks_per_node)
    changes: list[Change] = []
    cfg = _vocab(cfg, world, changes)
    train = _train(cfg, world, changes)
    layout = _layout(cfg, world, train.precision)
    cfg = dataclasses.replace(cfg, train=train, layout=layout, optim=_optim(cfg, world, changes))
    cfg = dataclasses.replace(cfg, checkpoint=_checkpoint(cfg))
    _fault_tolerance(cfg)
    if machine:
        _machine_checks(cfg, world)
    fsdp = layout.uses_fsdp() or rules.casts_once(layout, train.precision, train.mixed_precision)
    flat_zero1 = rules.uses_flat_zero1(layout, train.precision)
    return RunPlan(
        config=cfg,
        world=world,
        fsdp=fsdp,
        autocast=train.precision in ("bf16", "fp8") and not fsdp,
        fp8_all_gather=_fp8_all_gather(cfg, world, fsdp),
        flat_zero1=flat_zero1,
        ddp=layout.dp_cp > 1 and not fsdp and not flat_zero1,
        changes=tuple(changes),
        async_tp=rules.async_tp_mode(layout, world.device, train.compile, world.symm_mem),
    )


def _vocab(cfg: Config, world: World, changes: list[Change]) -> Config:
    """``model.vocab_size = "auto"``: a tokenizer.json's vocabulary rounded up to a multiple of 64 (any
    tp degree up to 64 divides it; the GEMMs keep aligned rows); the preset's with the byte tokenizer, or
    from ``model.init_from``'s weights (the preset must match them: the pre-flight compares the shapes)."""
    if "vocab_size" not in cfg.model.auto_shape:
        return cfg
    model = dataclasses.replace(cfg.model, auto_shape=tuple(a for a in cfg.model.auto_shape if a != "vocab_size"))
    shape, vocab = copy.copy(cfg.shape), world.tokenizer_vocab
    if vocab is not None and not cfg.model.init_from:
        shape.vocab_size = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        why = f"the vocabulary of data.tokenizer ({vocab:,} tokens) rounded up to a multiple of {VOCAB_MULTIPLE}"
        changes.append(Change("model.vocab_size", "auto", shape.vocab_size, why))
    return dataclasses.replace(cfg, model=model, shape=shape)


def _train(cfg: Config, world: World, changes: list[Change]) -> TrainConfig:
    t = cfg.train
    precision = t.precision if t.precision != "auto" else ("bf16" if world.device == "cuda" else "fp32")
    mixed = t.mixed_precision
    if precision == "fp32":
        mixed = "none"
    elif mixed in ("auto", "none"):
        mixed = "cast_once" if world.device == "cuda" else "autocast"
    chunk = t.loss_chunk_size
    split = cfg.layout.pp > 1 and schedule_name(cfg.layout.pp_schedule) in SPLIT_BACKWARD
    if chunk and split and not world.split_backward_custom_functions:
        why = "this torch's zero-bubble weight pass cannot cross the chunked loss's autograd.Function (compat.py)"
        changes.append(Change("train.loss_chunk_size", chunk, 0, why))
        chunk = 0
    return dataclasses.replace(
        t, device=world.device, precision=precision, mixed_precision=mixed, loss_chunk_size=chunk
    )


def _layout(cfg: Config, world: World, precision: str) -> Layout:
    """The degrees for this world, checked by the layout rules, with the pipeline's micro-batches written in."""
    lay = rules.resolve_degrees(cfg.layout, world.size)
    d = cfg.diloco
    diloco_rules = DiLoCoRules(**{k: getattr(d, k) for k in DiLoCoRules.__dataclass_fields__})
    t = cfg.train
    batch = Batch(
        t.seq_len, t.global_batch_size, world.ranks_per_node, world.device, precision, t.compile, diloco=diloco_rules
    )
    rules.check(lay, cfg.shape, batch)
    lay = lay.replace(ep_chunks=rules.ep_chunks_of(lay, world.ranks_per_node))
    if lay.pp > 1:  # (train.micro_batch_size = 0 stays: "the whole per-rank batch" is a rule, not a choice)
        return lay.replace(num_microbatches=lay.batch_split(t.global_batch_size).count)
    return lay


def _optim(cfg: Config, world: World, changes: list[Change]) -> OptimConfig:
    o, steps = cfg.optim, cfg.train.steps
    warmup = o.warmup_steps if o.warmup_steps >= 0 else min(100, steps // 10)
    if warmup > steps:
        changes.append(Change("optim.warmup_steps", warmup, steps, f"longer than the run (train.steps = {steps})"))
        warmup = steps
    impl = o.implementation
    if impl == "auto":  # fused: one kernel per step (CPU too since torch 2.4; equal to foreach within 1e-6)
        impl = "fused"
    return dataclasses.replace(o, warmup_steps=warmup, implementation=impl)


def _fault_tolerance(cfg: Config) -> None:
    """Replica groups: their settings and what they compose with (parallel/fault_tolerance/rules.py)."""
    h = cfg.health
    rollbacks = [k for k in ("on_nonfinite", "on_spike", "on_sdc") if getattr(h, k) == "rollback"]
    found = ft_rules.problems(cfg.fault_tolerance, cfg.layout, cfg.train.precision, rollbacks)
    if found:
        raise ConfigError(found[0].message)


def _checkpoint(cfg: Config) -> CheckpointConfig:
    c = cfg.checkpoint
    return dataclasses.replace(c, interval="young_daly") if c.interval == "auto" else c


def _machine_checks(cfg: Config, world: World) -> None:
    """What only the machine decides: CPU offload needs a GPU; fp8 needs torchao and an fp8 linear."""
    _offload_needs_a_gpu(cfg, world)
    if cfg.train.precision == "fp8":
        from meshforge.parallel.fp8 import model_fp8_plan

        model_fp8_plan(cfg.shape, list(cfg.train.fp8_exclude))


def _offload_needs_a_gpu(cfg: Config, world: World) -> None:
    if cfg.layout.offload == "cpu" and world.device != "cuda":
        raise ConfigError(
            "parallel.offload = 'cpu' on a CPU run: the state already lives in host memory; "
            "use parallel.offload = 'none'"
        )


def _fp8_all_gather(cfg: Config, world: World, fsdp: bool) -> bool:
    """FSDP2 gathers fp8 weights only on real fp8, tensorwise, where it gathers over more than one
    rank, and not under CPU offload (the scales' all-reduce cannot run on host-resident shards)."""
    t, lay = cfg.train, cfg.layout
    if t.precision != "fp8" or lay.offload == "cpu" or t.fp8_recipe != "tensorwise":
        return False
    return fsdp and rules.gathers_weights(lay) and world.fp8_native
