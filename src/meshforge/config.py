"""Typed run configuration: TOML files plus ``--section.key=value`` overrides.

Everything a run does is decided here, before any process starts, so that a config
that cannot run is refused with a message naming the key and the fix (DESIGN.md,
principle 4). The resolved config (every default and preset value filled in) is what
gets written to the run directory, so a run can be reproduced from it alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from meshforge.errors import ConfigError
from meshforge.parallel.mesh import resolve_degrees


@dataclass
class ModelConfig:
    """A preset name plus optional explicit shape fields that override it."""

    preset: str = "debug"
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    rope_theta: float | None = None
    rope_scaling: Literal["none", "llama3"] | None = None
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_seq_len: int | None = None
    init_std: float | None = None
    # Start from these weights instead of a random init: a Hugging Face Llama directory
    # or a meshforge weights directory (see `meshforge convert`).
    init_from: str = ""


@dataclass
class ParallelConfig:
    # Degrees of the mesh dimensions; their product is the world size. Any one of
    # dp_replicate, dp_shard, tp, pp, cp may be -1: whatever the others leave.
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # 0: DDP; 1: optimizer state sharded; 2: + gradients; 3: + parameters (FSDP2).
    zero_stage: int = 0
    # Reduce gradients on every micro-batch instead of only the last one (saves the
    # unsharded gradient memory under ZeRO-2/3 at the cost of more communication).
    sync_every_microbatch: bool = False
    ddp_bucket_mb: int = 25
    # Under tp > 1: run norms and residuals on sequence shards (reduce-scatter/all-gather
    # instead of all-reduce: same bytes, 1/tp of those activations). Off: replicated.
    sequence_parallel: bool = True
    # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv | dualpipev (parallel/pipeline.py)
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules: >= 2; V schedules: 2)
    # blocks per stage chunk, in pipeline order (pp x pp_virtual_stages entries); empty: balanced by cost
    pp_layers: list[int] = field(default_factory=list)
    num_microbatches: int = 0  # pipeline micro-batches per step and dp rank; 0: from train.micro_batch_size


@dataclass
class TrainConfig:
    steps: int = 200
    seq_len: int = 256
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 0  # sequences per forward pass per rank; 0: no accumulation
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    grad_clip: float = 1.0  # global-norm clipping; 0 turns it off
    compile: bool = False
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
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


@dataclass
class RunConfig:
    dir: str = ""  # empty: runs/<preset>-<date>-<time>
    overwrite: bool = False  # allow a run.dir that already holds a run's metrics


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


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "run": RunConfig,
}


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _fields_by_key(cls: type) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _suggest(word: str, options: typing.Iterable[str]) -> str:
    options = list(options)
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid: " + ", ".join(sorted(options))


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(name, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        hint = _suggest(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        raise ConfigError(
            f"{name} = {value!r} is not one of {', '.join(repr(c) for c in choices)}" + (f"; {hint}" if hint else "")
        )
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list, got {value!r} (e.g. [4, 4])")
        (item,) = typing.get_args(tp)
        return [_coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r} (quote it in TOML)")
    raise ConfigError(f"{name}: unsupported config type {tp}")  # pragma: no cover


def _set(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}] in {where}; {_suggest(section, SECTIONS)}")
    cls = SECTIONS[section]
    fields = _fields_by_key(cls)
    if key not in fields:
        raise ConfigError(f"unknown key {section}.{key} in {where}; {_suggest(key, fields)}")
    f = fields[key]
    hints = typing.get_type_hints(cls)
    setattr(getattr(cfg, section), f.name, _coerce(f"{section}.{key}", value, hints[f.name]))


def parse_value(text: str) -> Any:
    """Read an override value as a TOML literal (numbers, booleans, lists); else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a Config from an optional TOML file and ``{"section.key": value}`` overrides."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing TOML file to --config")
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def to_toml(cfg: Config) -> str:
    """TOML text of the config; keys whose value is None (unset) are left out."""
    lines = []
    for section, body in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for k, v in body.items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def resolve(cfg: Config, world_size: int = 1) -> Config:
    """Fill in presets and automatic values, then validate. Returns a new Config."""
    from meshforge.models.presets import model_args_from_config

    cfg = dataclasses.replace(
        cfg,
        **{s: dataclasses.replace(getattr(cfg, s)) for s in SECTIONS},
    )
    args = model_args_from_config(cfg.model)
    m = cfg.model
    for f in dataclasses.fields(args):
        if hasattr(m, f.name):
            setattr(m, f.name, getattr(args, f.name))
    for k, v in resolve_degrees(cfg.parallel, world_size).items():
        setattr(cfg.parallel, k, v)
    if cfg.optim.warmup_steps < 0:
        cfg.optim.warmup_steps = min(100, cfg.train.steps // 10)
    validate(cfg, world_size)
    return cfg


def validate(cfg: Config, world_size: int = 1) -> None:
    """Refuse configs that cannot run, naming the key and the fix."""
    from meshforge.models.presets import model_args_from_config

    t, o, p, m = cfg.train, cfg.optim, cfg.parallel, cfg.model
    args = model_args_from_config(m)

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(t.steps > 0, f"train.steps = {t.steps} must be > 0")
    need(t.seq_len > 0, f"train.seq_len = {t.seq_len} must be > 0")
    need(
        t.seq_len <= args.max_seq_len,
        f"train.seq_len = {t.seq_len} is above the model's max positions (model.max_seq_len = "
        f"{args.max_seq_len}); lower train.seq_len or raise model.max_seq_len",
    )
    need(t.global_batch_size > 0, f"train.global_batch_size = {t.global_batch_size} must be > 0")
    need(
        t.micro_batch_size >= 0,
        f"train.micro_batch_size = {t.micro_batch_size} must be >= 0 (0: no accumulation)",
    )
    need(t.grad_clip >= 0, f"train.grad_clip = {t.grad_clip} must be >= 0 (0 turns clipping off)")
    need(t.eval_interval >= 0, f"train.eval_interval = {t.eval_interval} must be >= 0 (0: only at the end)")
    need(t.eval_batches >= 0, f"train.eval_batches = {t.eval_batches} must be >= 0")
    need(
        t.precision != "fp8",
        "train.precision = 'fp8' is not available in this version of meshforge; use 'bf16' (or 'fp32')",
    )
    need(o.lr > 0, f"optim.lr = {o.lr} must be > 0")
    need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    need(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must be >= 0")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    need(o.eps > 0, f"optim.eps = {o.eps} must be > 0")
    need(o.warmup_steps >= -1, f"optim.warmup_steps = {o.warmup_steps} must be >= 0 (or -1 for automatic)")
    need(
        o.warmup_steps <= t.steps,
        f"optim.warmup_steps = {o.warmup_steps} is more than train.steps = {t.steps}; lower it",
    )
    need(o.decay_steps >= 0, f"optim.decay_steps = {o.decay_steps} must be >= 0 (0: the whole run)")
    need(0 <= cfg.data.val_fraction < 1, f"data.val_fraction = {cfg.data.val_fraction} must be in [0, 1)")
    need(cfg.metrics.log_interval > 0, f"metrics.log_interval = {cfg.metrics.log_interval} must be > 0")
    need(cfg.checkpoint.keep >= 1, f"checkpoint.keep = {cfg.checkpoint.keep} must be >= 1")
    c = cfg.checkpoint
    need(
        c.interval == "auto" or (isinstance(c.interval, int) and c.interval >= 0),
        f'checkpoint.interval = {c.interval!r} must be a number of steps >= 0 (0: no checkpoints) or "auto"',
    )
    need(c.mtbf_hours > 0, f"checkpoint.mtbf_hours = {c.mtbf_hours} must be > 0")

    need(p.ep >= 1 and p.pp_virtual_stages >= 1, "parallel.ep and parallel.pp_virtual_stages must be >= 1")
    need(0 <= p.zero_stage <= 3, f"parallel.zero_stage = {p.zero_stage} must be 0, 1, 2 or 3")
    need(p.ddp_bucket_mb > 0, f"parallel.ddp_bucket_mb = {p.ddp_bucket_mb} must be > 0")
    degrees = resolve_degrees(p, world_size)
    need(
        degrees["cp"] == 1,
        f"parallel.cp = {degrees['cp']}: context parallelism is not available in this version of meshforge; "
        "set parallel.cp = 1",
    )
    validate_tp(cfg, args, degrees, node_size())
    need(p.ep == 1, f"parallel.ep = {p.ep}: expert parallelism is not available in this version; set it to 1")
    need(
        degrees["dp_replicate"] == 1 or p.zero_stage >= 2,
        f"parallel.dp_replicate = {degrees['dp_replicate']} (HSDP: replicate across groups, shard within) needs "
        f"parallel.zero_stage = 2 or 3; for plain data parallel use parallel.dp_shard = "
        f"{degrees['dp_replicate'] * degrees['dp_shard']} with dp_replicate = 1",
    )
    dp = data_parallel_degree(cfg, world_size)
    micro = t.micro_batch_size or t.global_batch_size // dp
    need(
        t.global_batch_size % dp == 0,
        f"train.global_batch_size = {t.global_batch_size} is not divisible by the data-parallel degree {dp}; "
        f"use a multiple of {dp}, e.g. {max(dp, (t.global_batch_size // dp) * dp) or dp}",
    )
    need(
        micro > 0 and (t.global_batch_size // dp) % micro == 0,
        f"train.micro_batch_size = {t.micro_batch_size} must divide the per-rank batch "
        f"global_batch_size / dp = {t.global_batch_size // dp}",
    )
    if degrees["pp"] > 1:
        from meshforge.parallel.pipeline import validate_pipeline

        validate_pipeline(cfg, args, degrees["pp"], t.global_batch_size // dp)
        if not p.num_microbatches:  # resolved, so the run's config.toml says what ran
            from meshforge.parallel.pipeline import num_microbatches

            p.num_microbatches = num_microbatches(cfg, t.global_batch_size // dp)
    else:
        need(
            not p.pp_layers,
            f"parallel.pp_layers = {p.pp_layers} is set but parallel.pp = 1; set parallel.pp or leave pp_layers empty",
        )


def node_size() -> int | None:
    """Ranks per node when a launcher says so (torchrun's LOCAL_WORLD_SIZE), else unknown."""
    v = os.environ.get("LOCAL_WORLD_SIZE")
    return int(v) if v and v.isdigit() else None


def validate_tp(cfg: Config, args: Any, degrees: dict[str, int], ranks_per_node: int | None) -> None:
    """Tensor parallelism shards whole heads, FFN columns and vocabulary rows: each must divide."""
    tp = degrees["tp"]
    if tp == 1:
        return
    p, t = cfg.parallel, cfg.train

    def divisible(value: int, key: str, what: str, fix: str = "") -> None:
        if value % tp:
            smaller = max(d for d in range(1, tp) if tp % d == 0 and value % d == 0)
            raise ConfigError(
                f"{key} = {value} is not divisible by parallel.tp = {tp} (tensor parallelism splits the {what} "
                f"evenly over the tp ranks); {fix or f'use a parallel.tp that divides it (e.g. {smaller})'}"
            )

    divisible(args.heads, "model.heads", "query heads")
    divisible(args.kv_heads, "model.kv_heads", "key/value heads (grouped-query attention keeps whole kv heads)")
    divisible(args.ffn_hidden, "model.ffn_hidden", "feed-forward columns")
    padded = -(-args.vocab_size // tp) * tp
    divisible(
        args.vocab_size,
        "model.vocab_size",
        "vocabulary (embedding rows and head columns)",
        f"pad the vocabulary: set --model.vocab_size={padded} (the extra rows are never produced by the "
        "tokenizer and cost nothing but memory)",
    )
    if p.sequence_parallel:
        divisible(
            t.seq_len,
            "train.seq_len",
            "sequence under sequence parallelism",
            f"use a multiple of {tp} (e.g. {-(-t.seq_len // tp) * tp}) or set parallel.sequence_parallel = false",
        )
    if ranks_per_node is not None and tp > ranks_per_node:
        raise ConfigError(
            f"parallel.tp = {tp} is larger than the {ranks_per_node} ranks per node: tensor parallelism "
            "communicates on every layer and must stay on one node's fast links; use parallel.tp <= "
            f"{ranks_per_node} and scale out with data or pipeline parallelism"
        )
    if p.zero_stage == 1:
        raise ConfigError(
            f"parallel.zero_stage = 1 with parallel.tp = {tp}: ZeRO-1 (ZeroRedundancyOptimizer) does not take "
            "tensor-parallel shards; use parallel.zero_stage = 2 (the same communication as ZeRO-1, and "
            "gradients sharded too) or 0"
        )


def data_parallel_degree(cfg: Config, world_size: int) -> int:
    d = resolve_degrees(cfg.parallel, world_size)
    return d["dp_replicate"] * d["dp_shard"]
