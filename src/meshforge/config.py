"""Typed run configuration: TOML files plus ``--section.key=value`` overrides.

This file is the schema, parsing and value checks only (a value against its key's type:
``config_values.py``): it knows every key, its type and its allowed values, and refuses a
bad one with a message naming the key and the fix (fail loudly and early). Whether a
*layout* can run (degrees, divisibility, schedules) is decided by ``parallel/dims/``;
``meshforge/resolve.py`` puts the two together for a world size. The resolved config (every
default and preset value filled in) is what gets written to the run directory, so a run
can be reproduced from it alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from meshforge.config_help import HELP
from meshforge.config_values import coerce, toml_value, type_name
from meshforge.config_values import parse_value as parse_value  # re-exported: the CLI reads overrides
from meshforge.errors import ConfigError, suggest
from meshforge.layout import DILOCO_KEYS, TRAIN_KEYS, Layout
from meshforge.models.chunked_loss import DEFAULT_CHUNK
from meshforge.models.presets import model_shape
from meshforge.models.shape import ANALYSIS_ONLY, ModelShape


def _model_config() -> type:
    """[model]: a preset name, then every shape field of ModelShape as an optional override
    (None: the preset's value), then where to start from. Derived from ModelShape so that a
    new model field is a config key without being written twice."""
    hints = typing.get_type_hints(ModelShape)
    keys = [f.name for f in dataclasses.fields(ModelShape) if f.name not in ANALYSIS_ONLY]
    shape = [(k, hints[k] | None, field(default=None)) for k in keys]
    # init_from: start from these weights instead of a random init: a Hugging Face Llama
    # directory or a meshforge weights directory (see `meshforge convert`)
    return dataclasses.make_dataclass(
        "ModelConfig",
        [("preset", str, field(default="debug")), *shape, ("init_from", str, field(default=""))],
        namespace={"__doc__": "A preset name plus optional explicit shape fields that override it."},
    )


ModelConfig = _model_config()


def _parallel_config() -> type:
    """[parallel]: every field of ``Layout`` (meshforge/layout.py) but the [train] and [diloco] ones, so a new
    layout setting is a config key without being written twice. dp_shard defaults to -1
    (inferred); pp_layers is a list."""
    hints = typing.get_type_hints(Layout)
    out = []
    for f in dataclasses.fields(Layout):
        if f.name in TRAIN_KEYS or f.name in DILOCO_KEYS:
            continue
        if f.name == "pp_layers":
            out.append((f.name, list[int], field(default_factory=list)))
        else:
            out.append((f.name, hints[f.name], field(default=-1 if f.name == "dp_shard" else f.default)))
    return dataclasses.make_dataclass(
        "ParallelConfig", out, namespace={"__doc__": "The layout's degrees and settings (meshforge/layout.py)."}
    )


ParallelConfig = _parallel_config()


@dataclass
class TrainConfig:
    steps: int = 200
    seq_len: int = 256
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 0  # sequences per forward pass per rank; 0: no accumulation
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    # fp8 (torchao float8 training): scaling per tensor or per row; module-name patterns kept out of fp8
    # (linears whose dimensions are not multiples of 16 are always kept out)
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    fp8_exclude: list[str] = field(default_factory=lambda: ["output", "*router*"])
    # bf16/fp8 weights: cast_once (FSDP2's mixed-precision policy casts each weight once per micro-batch,
    # also on a world of one and DDP's layouts) or autocast (torch.autocast casts at every use);
    # auto: cast_once on CUDA, autocast on CPU (where FSDP2's per-unit host work costs more than the casts)
    mixed_precision: Literal["auto", "cast_once", "autocast"] = "auto"
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    loss_chunk_size: int = DEFAULT_CHUNK  # tokens per chunk of the head + cross-entropy; 0: full logits
    grad_clip: float = 1.0  # global-norm clipping; 0 turns it off
    compile: bool = False
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    skip_memory_check: bool = False  # start even where the planner's estimate exceeds the free memory
    eval_interval: int = 0  # 0: evaluate only at the end
    eval_batches: int = 4  # global batches of validation data per evaluation; 0: none


@dataclass
class OptimConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the decay ends at lr * min_lr_ratio
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = -1  # -1: min(100, steps // 10)
    decay_steps: int = 0  # 0: decay over the whole run
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"


@dataclass
class DataConfig:
    # Empty: the embedded default corpus (this Python's standard library sources).
    # Otherwise text files, directories, JSONL with a "text" field, or a prepared
    # token-shard directory (one with index.json, from `meshforge data prepare`).
    path: str = ""
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    val_fraction: float = 0.01
    cache_dir: str = ""  # empty: $MESHFORGE_CACHE or ~/.cache/meshforge
    allow_binary: bool = False  # train on files that are mostly not text (refused otherwise)


@dataclass
class CheckpointConfig:
    # steps between sharded training checkpoints (in run.dir/checkpoints); 0: none;
    # "auto": the Young/Daly optimum sqrt(2 x save cost x MTBF) from the measured save cost
    interval: int | str = 0
    keep: int = 3  # complete checkpoints kept (older ones are deleted)
    async_: bool = field(default=False, metadata={"key": "async"})  # write in the background
    # "latest": resume from the newest complete checkpoint in run.dir/checkpoints if there
    # is one; "none": never resume; or a checkpoint directory (or a checkpoints/ folder)
    load: str = "latest"
    mtbf_hours: float = 24.0  # mean time between failures of the job, for interval = "auto"
    save_final: bool = True  # write the final weights (also after Ctrl-C) to run.dir/final
    export_hf: bool = False  # also write run.dir/final as a Hugging Face directory


@dataclass
class MetricsConfig:
    log_interval: int = 10
    console: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    report: bool = True  # write run.dir/report.html when the run stops (rank 0; also after a crash)
    wandb: bool = False  # also log to Weights & Biases, offline (run.dir/wandb); needs the wandb package


@dataclass
class HealthConfig:
    # non-finite loss or gradient norm: skip the update on every rank, stop the run, or go back
    # to the last complete checkpoint and skip the batches since
    on_nonfinite: Literal["skip", "stop", "rollback"] = "skip"
    max_skipped: int = 10  # more skipped steps than this (non-finite or spikes) in one run stops it
    spike_threshold: float = 0.0  # loss above median + this many robust deviations is a spike; 0: off
    spike_window: int = 50  # steps in the running median / MAD of the loss
    on_spike: Literal["log", "skip", "rollback"] = "log"
    hang_timeout_s: float = 300.0  # no step finished for this long: report the collectives and exit; 0: off
    straggler_factor: float = 1.5  # a rank's compute time above this x the median is a straggler; 0: off
    text_warn_fraction: float = 0.05  # byte tokenizer: warn when more of data.path is not UTF-8 text


@dataclass
class ProfileConfig:
    start_step: int = 0  # first profiled step (1-based; 0: the first steps after warm-up, step 3)
    steps: int = 0  # steps traced with torch.profiler into run.dir/profile; 0: no tracing
    memory: bool = True  # CUDA: also record the traced steps' allocations (a memory snapshot); costs host time


@dataclass
class RunConfig:
    dir: str = ""  # empty: runs/<preset>-<date>-<time>
    overwrite: bool = False  # allow a run.dir that already holds a run's metrics


@dataclass
class DiLoCoConfig:
    """DiLoCo across islands of ranks (its layout rules live in parallel/dims/)."""

    islands: int = 1  # islands (outermost mesh dimension); 1 = off
    inner_steps: int = 50  # H: inner (AdamW) steps per round
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1  # Streaming DiLoCo: contiguous block groups synced at staggered steps
    delay: int = 0  # tau: inner steps a fragment's sync overlaps with compute before it is applied
    sync_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"  # pseudo-gradients on the wire (fp8: error feedback)
    warmup_steps: int = 0  # plain data parallelism over all islands first (the paper starts from a trained model)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "run": RunConfig,
    "health": HealthConfig,
    "profile": ProfileConfig,
    "diloco": DiLoCoConfig,
}


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _fields_by_key(cls: type) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _set(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}] in {where}; {suggest(section, SECTIONS)}")
    cls = SECTIONS[section]
    fields = _fields_by_key(cls)
    if key not in fields:
        elsewhere = [s for s, c in SECTIONS.items() if key in _fields_by_key(c)]
        if elsewhere:
            dashed = where.startswith("--")
            hint = " or ".join(f"--{s}.{key}" if dashed else f"[{s}] {key}" for s in elsewhere)
            raise ConfigError(
                f"unknown key {section}.{key} in {where}; {elsewhere[0]}.{key} exists: did you mean {hint}?"
            )
        raise ConfigError(f"unknown key {section}.{key} in {where}; {suggest(key, fields)}")
    f = fields[key]
    hints = typing.get_type_hints(cls)
    setattr(getattr(cfg, section), f.name, coerce(f"{section}.{key}", value, hints[f.name]))


def key_type(dotted: str) -> Any:
    """The annotation of config key ``section.key``, or None when there is no such key."""
    section, _, key = dotted.partition(".")
    f = _fields_by_key(SECTIONS[section]).get(key) if section in SECTIONS else None
    return typing.get_type_hints(SECTIONS[section])[f.name] if f else None


def describe_keys() -> str:
    """Every config key with its type, default and meaning, generated from the dataclasses (so --help
    can never miss a key) and config_help.HELP (docs/configuration.md's tables, checked by a test);
    model shape fields default to the preset's value."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = "the preset's value" if f.default is None else toml_value(f.default)
            else:
                default = toml_value(f.default_factory())  # type: ignore[misc]
            meaning = HELP.get(f"{section}.{_key(f)}", "")
            lines.append(f"  --{section}.{_key(f):<28} {type_name(hints[f.name]):<24} default {default}  {meaning}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a Config from an optional TOML file and ``{"section.key": value}`` overrides."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file to --config")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            line = e.object[: e.start].count(b"\n") + 1
            raise ConfigError(
                f"config file {p} is not a UTF-8 TOML file (line {line}, byte {e.start} is not UTF-8: "
                "is it a binary file?); "
                "pass a text TOML config such as configs/debug.toml"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}. Fix the syntax at that line.") from None
        for section, body in data.items():
            if not isinstance(body, dict):
                raise ConfigError(
                    f"{p}: top-level key '{section}' must be a section like [{section}]; "
                    f"put keys under one of: {', '.join(SECTIONS)}"
                )
            for key, value in body.items():
                _set(cfg, section, key, value, str(p))
    for dotted, value in (overrides or {}).items():
        if "." not in dotted:
            raise ConfigError(f"override --{dotted} must name a section and key, like --train.steps=100")
        section, key = dotted.split(".", 1)
        _set(cfg, section, key, value, f"--{dotted}")
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        out[section] = {_key(f): getattr(obj, f.name) for f in dataclasses.fields(cls)}
    return out


def to_toml(cfg: Config) -> str:
    """TOML text of the config; keys whose value is None (unset) are left out."""
    lines = []
    for section, body in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for k, v in body.items():
            if v is not None:
                lines.append(f"{k} = {toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def fill(cfg: Config) -> Config:
    """A copy with the preset's shape written into [model] and automatic values filled in,
    value-checked. Layout rules (degrees, divisibility) are not checked here: see
    ``meshforge.resolve.resolve``."""
    cfg = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s)) for s in SECTIONS})
    args = model_shape(cfg.model)
    for f in dataclasses.fields(args):
        if f.name not in ANALYSIS_ONLY:
            setattr(cfg.model, f.name, getattr(args, f.name))
    if cfg.optim.warmup_steps < 0:
        cfg.optim.warmup_steps = min(100, cfg.train.steps // 10)
    check_values(cfg)
    return cfg


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_values(cfg: Config) -> None:
    """Refuse values that are wrong whatever the layout, naming the key and the fix."""
    _check_train(cfg)
    _check_optim(cfg)
    d, c, p = cfg.data, cfg.checkpoint, cfg.parallel
    _need(0 <= d.val_fraction < 1, f"data.val_fraction = {d.val_fraction} must be in [0, 1)")
    _need(cfg.metrics.log_interval > 0, f"metrics.log_interval = {cfg.metrics.log_interval} must be > 0")
    _need(c.keep >= 1, f"checkpoint.keep = {c.keep} must be >= 1")
    _need(
        c.interval == "auto" or (isinstance(c.interval, int) and c.interval >= 0),
        f'checkpoint.interval = {c.interval!r} must be a number of steps >= 0 (0: no checkpoints) or "auto"',
    )
    _need(c.mtbf_hours > 0, f"checkpoint.mtbf_hours = {c.mtbf_hours} must be > 0")
    _need(p.ep >= 1 and p.pp_virtual_stages >= 1, "parallel.ep and parallel.pp_virtual_stages must be >= 1")
    _need(0 <= p.zero_stage <= 3, f"parallel.zero_stage = {p.zero_stage} must be 0, 1, 2 or 3")
    _need(p.ddp_bucket_mb > 0, f"parallel.ddp_bucket_mb = {p.ddp_bucket_mb} must be > 0")
    _need(p.num_microbatches >= 0, f"parallel.num_microbatches = {p.num_microbatches} must be >= 0 (0: automatic)")
    _check_health(cfg)


def _check_health(cfg: Config) -> None:
    h, pr = cfg.health, cfg.profile
    _need(h.max_skipped >= 0, f"health.max_skipped = {h.max_skipped} must be >= 0")
    _need(h.spike_threshold >= 0, f"health.spike_threshold = {h.spike_threshold} must be >= 0 (0: off)")
    _need(h.spike_window >= 5, f"health.spike_window = {h.spike_window} must be >= 5 steps")
    _need(h.hang_timeout_s >= 0, f"health.hang_timeout_s = {h.hang_timeout_s} must be >= 0 (0: off)")
    _need(
        h.straggler_factor == 0 or h.straggler_factor > 1,
        f"health.straggler_factor = {h.straggler_factor} must be > 1 (e.g. 1.5) or 0 (off)",
    )
    _need(0 < h.text_warn_fraction <= 1, f"health.text_warn_fraction = {h.text_warn_fraction} must be in (0, 1]")
    for key in ("on_nonfinite", "on_spike"):
        _need(
            getattr(h, key) != "rollback" or cfg.checkpoint.interval != 0,
            f"health.{key} = 'rollback' needs checkpoints to go back to; set checkpoint.interval > 0 (or 'auto')",
        )
    _need(pr.start_step >= 0 and pr.steps >= 0, "profile.start_step and profile.steps must be >= 0")


def _check_train(cfg: Config) -> None:
    t = cfg.train
    max_seq = cfg.model.max_seq_len or model_shape(cfg.model).max_seq_len
    _need(t.steps > 0, f"train.steps = {t.steps} must be > 0")
    _need(t.seq_len > 0, f"train.seq_len = {t.seq_len} must be > 0")
    _need(
        t.seq_len <= max_seq,
        f"train.seq_len = {t.seq_len} is above the model's max positions (model.max_seq_len = "
        f"{max_seq}); lower train.seq_len or raise model.max_seq_len",
    )
    _need(t.global_batch_size > 0, f"train.global_batch_size = {t.global_batch_size} must be > 0")
    _need(
        t.micro_batch_size >= 0,
        f"train.micro_batch_size = {t.micro_batch_size} must be >= 0 (0: no accumulation)",
    )
    _need(t.grad_clip >= 0, f"train.grad_clip = {t.grad_clip} must be >= 0 (0 turns clipping off)")
    _need(t.eval_interval >= 0, f"train.eval_interval = {t.eval_interval} must be >= 0 (0: only at the end)")
    _need(t.eval_batches >= 0, f"train.eval_batches = {t.eval_batches} must be >= 0")
    _need(
        t.loss_chunk_size >= 0,
        f"train.loss_chunk_size = {t.loss_chunk_size} must be >= 0 (tokens per loss chunk; 0: full logits)",
    )
    _need(
        not t.loss_chunk_size or t.precision != "fp8" or any(fnmatch.fnmatch("output", p) for p in t.fp8_exclude),
        f'train.loss_chunk_size = {t.loss_chunk_size} needs the head out of fp8: add "output" to '
        "train.fp8_exclude or set train.loss_chunk_size = 0",
    )


def _check_optim(cfg: Config) -> None:
    o, steps = cfg.optim, cfg.train.steps
    _need(o.lr > 0, f"optim.lr = {o.lr} must be > 0")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    _need(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must be >= 0")
    _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _need(o.eps > 0, f"optim.eps = {o.eps} must be > 0")
    _need(o.warmup_steps >= -1, f"optim.warmup_steps = {o.warmup_steps} must be >= 0 (or -1 for automatic)")
    _need(
        o.warmup_steps <= steps,
        f"optim.warmup_steps = {o.warmup_steps} is more than train.steps = {steps}; lower it",
    )
    _need(o.decay_steps >= 0, f"optim.decay_steps = {o.decay_steps} must be >= 0 (0: the whole run)")
