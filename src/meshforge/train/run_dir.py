"""The run directory and the checks that can fail on bad input, run once before any rank starts.

``preflight`` resolves the config, picks run.dir and makes sure the data fits the model
and the batch, so the CLI can refuse a bad run with one clear message; ``prepare_run_dir``
then creates (or clears, on run.overwrite) the directory that rank 0 writes into.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge import launch_env, run_lock
from meshforge.checkpoint import store
from meshforge.checkpoint.saver import resolve_load
from meshforge.config import Config, to_toml
from meshforge.data.dataset import TokenDataset
from meshforge.data.prepare import prepared_dir_for
from meshforge.data.tokenizer import load_tokenizer
from meshforge.disk import check_disk
from meshforge.errors import ConfigError, DataError
from meshforge.fit import check_fit, uses_cuda
from meshforge.health.flight_recorder import ENV as FLIGHT_RECORDER_ENV
from meshforge.health.text_check import refuse_binary
from meshforge.launch_env import restart_count
from meshforge.models.presets import model_shape
from meshforge.models.shape import ModelShape
from meshforge.parallel.fp8 import model_fp8_plan
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.precision import resolve_precision
from meshforge.resolve import resolve


def default_run_dir(cfg: Config) -> str:
    """runs/<preset>-<time>: a new directory per run unless run.dir names one."""
    return str(Path("runs") / f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")


def resuming(cfg: Config) -> bool:
    """Whether this start continues the run in run.dir (rather than starting a new one):
    an elastic restart always does; otherwise checkpoint.load = latest with a complete
    checkpoint there, unless run.overwrite asks for a fresh run."""
    if restart_count() > 0:
        return True
    if cfg.run.overwrite or cfg.checkpoint.load != "latest":
        return False
    return bool(store.list_complete(Path(cfg.run.dir) / "checkpoints"))


def check_run_dir(cfg: Config) -> Path:
    """Refuse to write a new run over an old one unless resuming it or run.overwrite is set."""
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir = {run_dir} exists and is not a directory; choose another run.dir")
    if (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite and not resuming(cfg):
        raise ConfigError(
            f"run.dir = {run_dir} already holds a run (metrics.jsonl) and no complete checkpoint to resume "
            "from (checkpoint.load = latest); choose another run.dir or pass --run.overwrite=true to replace it"
        )
    return run_dir


def dataset_root(cfg: Config) -> Path:
    """Where the token shards for cfg.data live (prepared once, cached by content)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    return prepared_dir_for(cfg.data.path, tok, cfg.data.val_fraction, cfg.data.cache_dir)


def open_data(cfg: Config, shape: ModelShape) -> TokenDataset:
    """Prepare (or reuse) the token shards for cfg.data and check they fit the model and batch."""
    tok = load_tokenizer(cfg.data.tokenizer)
    root = dataset_root(cfg)
    ds = TokenDataset(root, cfg.train.seq_len)
    if ds.tokenizer != tok.name:
        raise DataError(
            f"data at {root} was tokenized with '{ds.tokenizer}', but data.tokenizer = '{cfg.data.tokenizer}' "
            f"('{tok.name}'); set data.tokenizer to the tokenizer the data was prepared with"
        )
    vocab = shape.vocab_size
    if ds.vocab_size > vocab:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the tokenizer's vocabulary ({ds.vocab_size}); "
            f"set --model.vocab_size={ds.vocab_size} (or larger)"
        )
    if len(ds.train) < cfg.train.global_batch_size:
        raise DataError(
            f"the corpus at {cfg.data.path or 'the default corpus'} has {len(ds.train)} training sequences of "
            f"{cfg.train.seq_len + 1} tokens ({ds.train.tokens} tokens), fewer than one global batch of "
            f"{cfg.train.global_batch_size}; add data or lower train.global_batch_size / train.seq_len"
        )
    return ds


def check_precision_and_offload(cfg: Config, shape: ModelShape) -> None:
    """Before launch: fp8 needs torchao and a boundary that leaves some linear in fp8; CPU
    offload needs a GPU to offload from."""
    if cfg.train.precision == "fp8":
        model_fp8_plan(shape, cfg.train.fp8_exclude)
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cfg.parallel.offload == "cpu" and not cuda:
        raise ConfigError(
            "parallel.offload = 'cpu' on a CPU run: the state already lives in host memory; "
            "use parallel.offload = 'none'"
        )


def preflight(cfg: Config, world_size: int, launcher: bool = False) -> Config:
    """Resolve and validate the config, check that it fits the device's memory, pick the run dir,
    and make sure the data is usable. ``launcher``: run by `--nproc N`'s launcher, not a rank."""
    cfg = resolve(cfg, world_size)
    if cfg.train.precision == "auto":
        cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
        cfg.train.precision = resolve_precision("auto", torch.device("cuda" if cuda else "cpu"))
    shape = model_shape(cfg.model)
    check_precision_and_offload(cfg, shape)
    if cfg.model.init_from and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(f"model.init_from = {cfg.model.init_from} is not a directory of weights")
    if not cfg.run.dir:
        cfg.run.dir = default_run_dir(cfg)
    check_run_dir(cfg)
    # A run that cannot fit its device hears that first, before any disk or data check. A
    # launcher on CUDA leaves the GPUs to the ranks (no CUDA context here): rank 0 then checks
    # the memory and after it the disk; the launcher still prepares the data once.
    ranks_check_fit = launcher and uses_cuda(cfg)
    if not ranks_check_fit:
        check_fit(cfg, world_size, launch_env.local_rank(), launch_env.local_world_size() or world_size)
    refuse_binary(cfg.data.path, cfg.data.allow_binary)
    if not ranks_check_fit:
        check_disk(cfg)  # writable, and room for a checkpoint: refused here rather than mid-run
    open_data(cfg, shape)
    return cfg


def prepare_run_dir(cfg: Config) -> Path:
    """Create run.dir (clearing an old run only when run.overwrite is set and this is not a
    restart) and write config.toml."""
    run_dir = check_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_lock.hold(run_dir, quiet=restart_count() > 0)  # before touching anything in it
    if cfg.run.overwrite and restart_count() == 0:
        for name in ("metrics.jsonl", "events.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        for name in ("tensorboard", "final", "final-hf", "checkpoints"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    store.clean_incomplete(run_dir / "checkpoints")
    return run_dir


def event_writer(cfg: Config) -> Callable[..., None]:
    """Append one event to run.dir/events.jsonl from any rank (before or without a logger)."""

    def write(event: str, **fields: Any) -> None:
        rec = {"time": time.time(), "event": event, **fields}
        path = Path(cfg.run.dir) / "events.jsonl"
        if path.parent.is_dir():
            with path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if event == "checkpoint_skipped":  # say it where people look, too
            what = f"skipped checkpoint {fields.get('path')} ({fields.get('reason')}); trying an older one"
            print(f"meshforge: warning: {what}", file=sys.stderr)

    return write


def agree_on_start(cfg: Config, mesh: Mesh) -> tuple[Config, str | None]:
    """Rank 0 prepares run.dir and picks the checkpoint to resume from; every rank gets its
    run.dir, precision and that checkpoint."""
    resume = None
    if mesh.is_main:
        prepare_run_dir(cfg)
        if resuming(cfg) or cfg.checkpoint.load not in ("latest", "none", ""):
            path, _ = resolve_load(cfg.checkpoint.load, Path(cfg.run.dir) / "checkpoints", event_writer(cfg))
            resume = str(path) if path else None
    if not mesh.distributed:
        return cfg, resume
    obj = [cfg.run.dir, cfg.train.precision, resume]
    dist.broadcast_object_list(obj, src=0)
    run = dataclasses.replace(cfg.run, dir=obj[0])
    return dataclasses.replace(cfg, run=run, train=dataclasses.replace(cfg.train, precision=obj[1])), obj[2]


DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def launch_config(cfg: Config, world: int) -> Config:
    """This rank's resolved config (rank 0 also runs ``preflight``), with the environment that
    must be set before the process group starts."""
    for k, v in DETERMINISTIC_ENV.items():
        if cfg.train.deterministic:
            os.environ.setdefault(k, v)
    os.environ.setdefault(*FLIGHT_RECORDER_ENV)  # the hang watchdog reads it (before the process group starts)
    if world == 1 or launch_env.rank() == 0:
        return preflight(cfg, world)
    cfg = resolve(cfg, world)
    if uses_cuda(cfg):  # each rank holds the estimate against its own GPU (rank 0 did in preflight)
        check_fit(cfg, world, launch_env.local_rank())
    return cfg
