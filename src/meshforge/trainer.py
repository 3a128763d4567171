"""The step loop: micro-batches, gradient accumulation, clipping, LR schedule, optimizer
step, evaluation, metrics and the final save.

``preflight`` does everything that can fail on bad input (config, run directory, data,
vocabulary) so the CLI can run it once before starting any ranks; ``train`` is what
each rank runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import resource
import shutil
import signal
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from meshforge import faults
from meshforge.checkpoint import sharded, store
from meshforge.checkpoint.manager import (
    Checkpointer,
    model_shape_hash,
    resolve_load,
    restart_count,
    set_rng_state,
    young_daly_steps,
)
from meshforge.checkpoint.store import CheckpointError
from meshforge.checkpoint.weights import load_pretrained, save_weights, shape_mismatch
from meshforge.config import Config, to_toml
from meshforge.data.dataset import TokenDataset
from meshforge.data.prepare import prepared_dir_for
from meshforge.data.sampler import GlobalBatchSampler
from meshforge.data.tokenizer import load_tokenizer
from meshforge.errors import ConfigError, DataError
from meshforge.metrics.gantt import draw_gantt
from meshforge.metrics.memory import GIB, gathered_param_bytes, state_bytes
from meshforge.metrics.mfu import peak_flops, utilization
from meshforge.metrics.sinks import MetricsLogger
from meshforge.models.flops import hardware_flops_per_token, model_flops_per_token, num_params
from meshforge.models.hf import save_hf_state
from meshforge.models.llama import build_model
from meshforge.models.presets import model_args_from_config
from meshforge.parallel.comm_stats import CommCounter
from meshforge.parallel.data_parallel import gradient_sync, make_optimizer
from meshforge.parallel.dims import rank_layout
from meshforge.parallel.grad_clip import clip_grad_norm
from meshforge.parallel.mesh import Mesh, build_mesh, shutdown
from meshforge.parallel.parallelize import is_sharded, parallelize, parallelize_pipeline, uses_autocast
from meshforge.parallel.pipeline import Pipeline, Timeline
from meshforge.parallel.precision import autocast, resolve_precision
from meshforge.parallel.tensor_parallel import local_value, loss_context, match_grad_layouts
from meshforge.resolve import layout, resolve

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# ----------------------------------------------------------------------------- preflight


def default_run_dir(cfg: Config) -> str:
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
    tok = load_tokenizer(cfg.data.tokenizer)
    return prepared_dir_for(cfg.data.path, tok, cfg.data.val_fraction, cfg.data.cache_dir)


def open_data(cfg: Config) -> TokenDataset:
    """Prepare (or reuse) the token shards for cfg.data and check they fit the model and batch."""
    tok = load_tokenizer(cfg.data.tokenizer)
    root = dataset_root(cfg)
    ds = TokenDataset(root, cfg.train.seq_len)
    if ds.tokenizer != tok.name:
        raise DataError(
            f"data at {root} was tokenized with '{ds.tokenizer}', but data.tokenizer = '{cfg.data.tokenizer}' "
            f"('{tok.name}'); set data.tokenizer to the tokenizer the data was prepared with"
        )
    vocab = model_args_from_config(cfg.model).vocab_size
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


def preflight(cfg: Config, world_size: int) -> Config:
    """Resolve and validate the config, pick the run dir, and make sure the data is usable."""
    cfg = resolve(cfg, world_size)
    if cfg.train.precision == "auto":
        cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
        cfg.train.precision = resolve_precision("auto", torch.device("cuda" if cuda else "cpu"))
    if cfg.model.init_from and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(f"model.init_from = {cfg.model.init_from} is not a directory of weights")
    if not cfg.run.dir:
        cfg.run.dir = default_run_dir(cfg)
    check_run_dir(cfg)
    open_data(cfg)
    return cfg


# ----------------------------------------------------------------------------- schedule


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then decay to a floor."""
    o = cfg.optim
    peak, floor = o.lr, o.lr * o.min_lr_ratio
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return peak
    end = o.decay_steps or cfg.train.steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, end - o.warmup_steps))
    if o.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: Config, mesh: Mesh) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and embeddings (incl. a head tied to the embedding)."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or "tok_embeddings" in name else decay).append(p)
    o = cfg.optim
    impl = o.implementation
    if impl == "auto":
        impl = "fused" if mesh.device.type == "cuda" else "foreach"
    kw: dict[str, Any] = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw.update(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return make_optimizer(groups, torch.optim.AdamW, kw, mesh, cfg.parallel.zero_stage)


def peak_mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ----------------------------------------------------------------------------- trainer


class Trainer:
    """One rank's training state and loop."""

    def __init__(self, cfg: Config, mesh: Mesh, stream: TextIO | None = None, resume: Path | None = None):
        self.cfg, self.mesh, self.device = cfg, mesh, mesh.device
        t = cfg.train
        self.precision = resolve_precision(t.precision, self.device)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(t.seed)

        if mesh.distributed and not mesh.is_main:
            dist.barrier()  # let rank 0 build the data cache first
        self.data = open_data(cfg)
        if mesh.distributed and mesh.is_main:
            dist.barrier()

        self.args = model_args_from_config(cfg.model)
        self.model = build_model(self.args, device="meta")
        self.pipeline: Pipeline | None = None
        if mesh.degrees["pp"] > 1:  # self.model: this rank's chunks, under the whole model's names
            self.model, self.pipeline = parallelize_pipeline(self.model, cfg, mesh, seed=t.seed)
            self.train_model = self.model
        else:
            self.train_model = parallelize(self.model, cfg, mesh, seed=t.seed)
        if cfg.model.init_from:
            pre = load_pretrained(cfg.model.init_from, device="cpu")
            diff = shape_mismatch(pre.args, self.args)
            if diff:
                raise ConfigError(
                    f"model.init_from = {cfg.model.init_from} has another shape than [model]: " + "; ".join(diff)
                )
            mine = dict(self.model.named_parameters())
            full = {k: v for k, v in pre.state_dict().items() if k in mine}  # a pipeline rank holds some
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
        self.sharded = is_sharded(cfg, mesh)
        self.tp = mesh.degrees["tp"] > 1
        self.autocast = uses_autocast(cfg, mesh)
        self.optimizer = build_optimizer(self.model, cfg, mesh)
        self.comm = CommCounter(mesh.groups_by_axis()).activate() if mesh.distributed else None
        self.state_mem: dict[str, int] = {}
        self.comm_bytes: dict[str, dict[str, float]] = {}

        self.sampler = GlobalBatchSampler(len(self.data.train), t.global_batch_size, t.seed)
        self.local_batch = t.global_batch_size // mesh.dp_size
        self.micro = t.micro_batch_size or self.local_batch
        if self.pipeline:  # the schedule runs the micro-batches
            self.micro = self.local_batch // self.pipeline.m
        self.accum = self.local_batch // self.micro
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.flops_per_token = model_flops_per_token(self.args, t.seq_len)
        self.hw_flops_per_token = hardware_flops_per_token(self.args, t.seq_len, t.activation_checkpoint)
        self.peak = peak_flops(self.device, self.precision)
        self.step = 0
        self.tokens_seen = 0
        self.pp_stats: dict[str, Any] = {}
        self.gantt_step = min(3, t.steps)  # past the first steps' warm-up
        self._stop = False
        self.logger = None
        run_dir = Path(cfg.run.dir)
        meta = store.read_meta(resume) if resume else None
        dropped = 0
        if mesh.is_main and (meta or restart_count()):  # steps after the resume point are redone
            dropped = trim_metrics(run_dir, meta["step"] if meta else 0)
        if mesh.is_main:
            m = cfg.metrics
            self.logger = MetricsLogger(run_dir, t.steps, m.console, m.jsonl, m.tensorboard, stream)
        self.checkpointer = Checkpointer(
            run_dir / "checkpoints", mesh.rank, mesh.distributed, cfg.checkpoint.keep, self.event, self.device
        )
        self.interval = cfg.checkpoint.interval
        self.next_save = self._first_save_step()
        if restart_count():
            self.event("restart", attempt=restart_count(), resume_from=str(resume) if resume else None)
        if resume:
            self._resume(resume, meta, dropped)

    def event(self, name: str, **fields: Any) -> None:
        if self.logger:
            self.logger.event(name, **fields)

    # -- checkpoints ----------------------------------------------------------------------

    def _first_save_step(self) -> int | None:
        if self.interval == 0:
            return None
        if self.interval == "auto":  # measure one save early, then follow Young/Daly
            return self.step + max(1, min(10, self.cfg.train.steps // 10))
        return (self.step // self.interval + 1) * self.interval

    def _resume(self, path: Path, meta: dict[str, Any], dropped: int) -> None:
        from meshforge.models.llama import ModelArgs

        saved = ModelArgs(**meta["model"])
        diff = shape_mismatch(saved, self.args)
        if diff:
            raise CheckpointError(
                f"checkpoint {path / 'meta.json'} was written for another model shape ({'; '.join(diff)}); set [model] "
                "to the checkpoint's shape, or start a new run (checkpoint.load = none or another run.dir)"
            )
        t0 = time.perf_counter()
        sharded.load(self.model, self.optimizer, path)
        self.step = int(meta["step"])
        self.tokens_seen = int(meta["tokens_seen"])
        self.sampler.load_state_dict(meta["sampler"])
        same_layout = meta["world_size"] == self.mesh.world_size and meta["degrees"] == self.mesh.degrees
        rank_file = path / f"rank-{self.mesh.rank:05d}.json"
        if same_layout and rank_file.exists():
            set_rng_state(json.loads(rank_file.read_text())["rng"])
        self.next_save = self._first_save_step()
        self.event(
            "resumed",
            path=str(path),
            step=self.step,
            saved_layout=meta["degrees"],
            layout=self.mesh.degrees,
            resharded=not same_layout,
            load_s=round(time.perf_counter() - t0, 4),
            metrics_dropped=dropped,
        )
        if self.logger:
            self.logger.print(
                f"resumed from {path} at step {self.step}"
                + (f" (saved on {meta['world_size']} ranks {meta['degrees']}, resharded)" if not same_layout else "")
            )

    def save_checkpoint(self) -> None:
        meta = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "sampler": self.sampler.state_dict(),
            "model": dataclasses.asdict(self.args),
            "model_hash": model_shape_hash(dataclasses.asdict(self.args)),
            "world_size": self.mesh.world_size,
            "degrees": self.mesh.degrees,
            "zero_stage": self.cfg.parallel.zero_stage,
            "config": to_toml(self.cfg),
            "time": time.time(),
            "torch": torch.__version__,
        }
        state = sharded.training_state(self.model, self.optimizer)
        self.checkpointer.save(self.step, state, meta, background=self.cfg.checkpoint.async_)

    def _maybe_save(self, last: bool, step_time_s: float) -> None:
        if self.next_save is None:
            return
        if self.step < self.next_save and not last:
            return
        self.save_checkpoint()
        if self.interval == "auto":
            steps, seconds = young_daly_steps(
                self.checkpointer.last_blocking_s or 0.0, self.cfg.checkpoint.mtbf_hours, step_time_s
            )
            if self.mesh.distributed:  # every rank must save at the same steps: rank 0 decides
                agreed = torch.tensor([steps], device=self.device)
                dist.broadcast(agreed, src=0)
                steps = int(agreed.item())
            self.event(
                "checkpoint_interval",
                steps=steps,
                seconds=round(seconds, 2),
                blocking_s=round(self.checkpointer.last_blocking_s or 0.0, 4),
                mtbf_hours=self.cfg.checkpoint.mtbf_hours,
                step_time_s=round(step_time_s, 4),
            )
            self.next_save = self.step + steps
        else:
            self.next_save = self._first_save_step()

    # -- one optimizer step ---------------------------------------------------------------

    def train_step(self, batch: torch.Tensor) -> tuple[float, float]:
        """Forward/backward over ``accum`` micro-batches of this rank's slice, then one update.

        Returns the loss averaged over the whole global batch and the pre-clip global grad norm.
        """
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.comm:
            self.comm.activate().reset()
        if self.pipeline:
            return self._pipeline_step(inputs, targets)
        total = torch.zeros((), device=self.device)
        gathered = 0
        sync_all = self.cfg.parallel.sync_every_microbatch
        for i in range(self.accum):
            sl = slice(i * self.micro, (i + 1) * self.micro)
            last = i == self.accum - 1
            with gradient_sync(self.train_model, last or sync_all), loss_context(self.tp):
                with autocast(self.device, self.precision) if self.autocast else contextlib.nullcontext():
                    logits = self.train_model(inputs[sl])
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets[sl].flatten())
                if last and self.sharded:
                    gathered = gathered_param_bytes(self.model)  # what ZeRO-2 keeps gathered for backward
                (loss / self.accum).backward()
            total += local_value(loss.detach())
        loss = total / self.accum
        if self.mesh.distributed:
            dist.all_reduce(loss, group=self.mesh.group("dp"))
            loss /= self.mesh.dp_size
        if self.tp and not self.sharded:
            match_grad_layouts(self.model)
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.grad_clip or float("inf"))
        self.optimizer.step()
        self.state_mem = {**state_bytes(self.model, self.optimizer), "gathered_params": gathered}
        self.optimizer.zero_grad(set_to_none=True)
        if self.comm:
            self.comm_bytes = self.comm.snapshot()
        return float(loss), float(grad_norm)

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        """The same step with the micro-batches run by the pipeline schedule; the loss is
        known on the last stage and shared over the pp group, the gradient norm adds up
        over the stages."""
        pipe = self.pipeline
        loss = pipe.step(inputs, targets, self.mesh.rank)
        dist.all_reduce(loss, group=self.mesh.group("pp"))
        if self.mesh.dp_size > 1:
            dist.all_reduce(loss, group=self.mesh.group("dp"))
            loss /= self.mesh.dp_size
        if self.tp and not self.sharded:
            match_grad_layouts(self.model)
        grad_norm = clip_grad_norm(
            self.model.parameters(), self.cfg.train.grad_clip or float("inf"), self.mesh.group("pp")
        )
        self.optimizer.step()
        self.state_mem = {**state_bytes(self.model, self.optimizer), "gathered_params": 0}
        self.optimizer.zero_grad(set_to_none=True)
        self._pipeline_stats()
        if self.comm:
            self.comm_bytes = self.comm.snapshot()
        return float(loss), float(grad_norm)

    def _pipeline_stats(self) -> None:
        """Measured bubble (mean over the pp ranks) next to the theory, in-flight micro-batches
        per pp rank, and once per run the Gantt chart of a step."""
        pipe = self.pipeline
        tl = pipe.timeline()
        group = self.mesh.group("pp")
        mine = torch.tensor([pipe.bubble(), float(tl.max_in_flight()), peak_mem_gib(self.device)])
        every = [torch.zeros_like(mine) for _ in range(pipe.pp)]
        dist.all_gather(every, mine.to(self.device), group=group)
        every = [e.cpu() for e in every]
        self.pp_stats = {
            "bubble_fraction": sum(float(e[0]) for e in every) / pipe.pp,
            "bubble_theory": pipe.theory(),
            "pp_in_flight": [int(e[1]) for e in every],
        }
        if self.device.type == "cuda":
            self.pp_stats["pp_peak_mem_gib"] = [round(float(e[2]), 3) for e in every]
        if self.step + 1 == self.gantt_step:
            self._write_gantt(tl)

    def _write_gantt(self, tl: Timeline) -> None:
        """Gather every rank's timeline of this step to rank 0 and draw it."""
        every: list = [None] * self.mesh.world_size
        dist.all_gather_object(every, tl)
        if not self.mesh.is_main:
            return
        pipe = self.pipeline
        coords = rank_layout(self.mesh.degrees)
        rows = [t for t in every if all(v == 0 for k, v in coords[t.rank].items() if k not in ("pp", "rank"))]
        rows.sort(key=lambda t: coords[t.rank]["pp"])
        run_dir = Path(self.cfg.run.dir)
        title = (
            f"{pipe.name}, pp={pipe.pp}"
            + (f" x {pipe.v} chunks" if len(pipe.chunks) > 1 else "")
            + f", m={pipe.m}, step {self.step + 1}: measured bubble {self.pp_stats['bubble_fraction']:.3f}"
            + f" (theory {pipe.theory():.3f})"
        )
        draw_gantt(rows, run_dir / "pipeline_gantt.png", title)
        (run_dir / "pipeline_timeline.json").write_text(json.dumps([dataclasses.asdict(t) for t in rows], indent=0))
        self.event("pipeline_gantt", step=self.step + 1, path=str(run_dir / "pipeline_gantt.png"))

    def step_once(self) -> tuple[float, float, float]:
        """Set the LR, fetch this rank's slice of the next global batch, and take one step."""
        lr = lr_at(self.cfg, self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        idx = self.sampler.next_batch(self.mesh.dp_rank, self.mesh.dp_size)
        batch = self.data.train.get(idx).to(self.device, non_blocking=True)
        loss, grad_norm = self.train_step(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return loss, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over eval_batches global batches' worth of validation sequences.

        The sequences are spread evenly over the whole validation split (not its first
        block), and the set is a whole number of global batches split contiguously over
        the data-parallel ranks, so every layout evaluates the same sequences."""
        val = self.data.val
        B = self.cfg.train.global_batch_size
        n = min(self.cfg.train.eval_batches * B, len(val) // B * B)
        if n == 0:
            return None
        chosen = np.arange(n, dtype=np.int64) * len(val) // n
        per = n // self.mesh.dp_size
        mine = chosen[self.mesh.dp_rank * per : (self.mesh.dp_rank + 1) * per]
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        if self.pipeline:  # whole per-rank batches through the schedule, forward only
            for s in range(0, per, self.local_batch):
                batch = val.get(mine[s : s + self.local_batch]).to(self.device)
                total += self.pipeline.eval_loss(batch[:, :-1], batch[:, 1:])
            dist.all_reduce(total, group=self.mesh.group("pp"))
            per = 0
        for s in range(0, per, self.micro):
            batch = val.get(mine[s : s + self.micro]).to(self.device)
            with autocast(self.device, self.precision) if self.autocast else contextlib.nullcontext():
                logits = self.model(batch[:, :-1])
            with loss_context(self.tp):
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += local_value(loss).double()
        if self.mesh.distributed:
            dist.all_reduce(total, group=self.mesh.group("dp"))
        return float(total) / (n * self.cfg.train.seq_len)

    # -- the loop -------------------------------------------------------------------------

    def _request_stop(self, signum, frame) -> None:
        if self._stop:  # a second Ctrl-C means "now"
            raise KeyboardInterrupt
        self._stop = True
        if self.logger:
            self.logger.print(
                "\nstop requested: finishing the current step, then saving what we have "
                "(press Ctrl-C again to abort at once)"
            )

    def _agree_to_stop(self) -> bool:
        if not self.mesh.distributed:
            return self._stop
        flag = torch.tensor([1.0 if self._stop else 0.0], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def fit(self) -> dict[str, Any]:
        cfg, t, log = self.cfg, self.cfg.train, self.logger
        old_handlers = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            result = self._fit(cfg, t, log)
            self.checkpointer.close()
            return result
        except BaseException:
            self.checkpointer.abandon()
            raise
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if log:
                log.close()

    def _fit(self, cfg: Config, t: Any, log: MetricsLogger | None) -> dict[str, Any]:
        if self.step >= t.steps:  # resumed from a checkpoint at (or past) the end
            if log:
                log.event("nothing_to_do", step=self.step, steps=t.steps)
                log.print(
                    f"already trained to step {self.step} (train.steps = {t.steps}); raise train.steps to continue"
                )
            return {"steps": self.step, "interrupted": False, "tokens": self.tokens_seen, "already_done": True}
        if log:
            log.event(
                "run_start",
                world_size=self.mesh.world_size,
                device=str(self.device),
                precision=self.precision,
                params=num_params(self.args),
                peak_flops=self.peak,
            )
            log.print(
                f"meshforge: training {cfg.model.preset} ({num_params(self.args) / 1e6:.2f}M params) for {t.steps} "
                f"steps on {self.mesh.world_size} x {self.device.type} ({self.precision}) | batch "
                f"{t.global_batch_size} x {t.seq_len} tokens, {self.accum} micro-batch(es) of {self.micro} per rank "
                f"| data {self.data.root} ({len(self.data.train)} sequences) | run dir {cfg.run.dir}"
            )
        losses: list[float] = []
        times: list[float] = []
        window: list[float] = []
        interrupted = False
        val_loss = None
        t_start = time.perf_counter()
        while self.step < t.steps:
            t0 = time.perf_counter()
            loss, grad_norm, lr = self.step_once()
            faults.maybe_kill("step", self.mesh.rank, self.step)  # tests: die right after this step
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            window.append(dt)
            stop = self._agree_to_stop()
            last = self.step == t.steps or stop
            if log and (self.step % cfg.metrics.log_interval == 0 or last):
                step_time = sum(window) / len(window)
                tps = self.tokens_per_step / step_time
                per_device = tps / self.mesh.world_size
                log.log_step(
                    {
                        "step": self.step,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens_per_s": tps,
                        "step_time_s": step_time,
                        "mfu": utilization(self.flops_per_token, per_device, self.peak),
                        "hfu": utilization(self.hw_flops_per_token, per_device, self.peak),
                        "peak_mem_gib": peak_mem_gib(self.device),
                        "tokens_seen": self.tokens_seen,
                        "state_mem_gib": sum(self.state_mem.values()) / GIB,
                        "state_mem_bytes": dict(self.state_mem),
                        "comm_bytes": {axis: sum(k.values()) for axis, k in self.comm_bytes.items()},
                        "comm_bytes_by_kind": self.comm_bytes,
                        **self.pp_stats,
                    }
                )
                window = []
            self.checkpointer.poll()
            self._maybe_save(last, sum(times[-10:]) / len(times[-10:]))
            if t.eval_interval and self.step % t.eval_interval == 0 and not last:
                v = self.evaluate()
                if log and v is not None:
                    log.log_eval(self.step, v)
            if stop and self.step < t.steps:
                interrupted = True
                if log:
                    log.event("interrupted", step=self.step)
                break
        self.checkpointer.wait()
        wall = time.perf_counter() - t_start
        if t.eval_batches:
            val_loss = self.evaluate()
            if log and val_loss is not None:
                log.log_eval(self.step, val_loss)
        warm = times[max(1, len(times) // 10) :] or times  # leave out the first steps (compile, caches)
        tps = self.tokens_per_step * len(warm) / sum(warm)
        summary = {
            "steps": self.step,
            "interrupted": interrupted,
            "tokens": self.tokens_seen,
            "wall_time_s": wall,
            "first_loss": losses[0],
            "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "val_loss": val_loss,
            "tokens_per_s": tps,
            "mfu": utilization(self.flops_per_token, tps / self.mesh.world_size, self.peak),
            "hfu": utilization(self.hw_flops_per_token, tps / self.mesh.world_size, self.peak),
            "peak_mem_gib": peak_mem_gib(self.device),
        }
        self._save_final(summary)
        if log:
            log.event("run_end", **summary)
            vl = f" | val loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50)):.2f})" if val_loss is not None else ""
            log.print(
                f"{'stopped early' if interrupted else 'done'}: {self.step} steps in {wall:.1f}s | "
                f"{self.tokens_seen / 1e6:.2f}M tokens | loss {summary['first_loss']:.4f} -> "
                f"{summary['final_loss']:.4f}{vl} | {tps:,.0f} tok/s | MFU {100 * summary['mfu']:.1f}% | "
                f"HFU {100 * summary['hfu']:.1f}% | peak mem {summary['peak_mem_gib']:.2f} GiB | {cfg.run.dir}"
            )
        return summary

    def _full_state(self) -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on the CPU
        return get_model_state_dict(self.model, options=opts)

    def _pipeline_full_state(self) -> dict[str, torch.Tensor] | None:
        """Every pipeline rank gathers its chunks' full weights (over dp and tp), then the
        ranks at dp = tp = 0 send theirs along the pp axis to rank 0, which merges them."""
        opts = StateDictOptions(full_state_dict=True)
        local = {k: v.detach().cpu() for k, v in get_model_state_dict(self.model, options=opts).items()}
        coords = rank_layout(self.mesh.degrees)[self.mesh.rank]
        if any(v for k, v in coords.items() if k not in ("pp", "rank")):
            return None
        parts: list | None = [None] * self.pipeline.pp if self.mesh.is_main else None
        dist.gather_object(local, parts, dst=0, group=self.mesh.group("pp"))
        if not self.mesh.is_main:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: _param_order(kv[0])))

    def _save_final(self, summary: dict[str, Any]) -> None:
        """Gather the full weights (a collective under sharding: every rank calls) and let
        rank 0 write them."""
        want = self.cfg.checkpoint.save_final or self.cfg.checkpoint.export_hf
        state = None
        if want:
            # gathering TP x FSDP shards takes two all-gathers per tensor, which DTensor warns
            # about per tensor; for a one-off save that is fine
            quiet = logging.getLogger("torch.distributed.tensor._redistribute")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                state = self._pipeline_full_state() if self.pipeline else self._full_state()
            finally:
                quiet.setLevel(level)
        if not self.mesh.is_main:
            return
        run_dir = Path(self.cfg.run.dir)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if self.cfg.checkpoint.save_final:
            path = save_weights(self.args, state, run_dir / "final")
            self.logger.event("final_weights", path=str(path), step=self.step)
        if self.cfg.checkpoint.export_hf:
            path = save_hf_state(self.args, state, run_dir / "final-hf")
            self.logger.event("export_hf", path=str(path), step=self.step)


def _param_order(name: str) -> tuple:
    """The whole model's parameter order: embedding, blocks by index, norm, head."""
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("tok_embeddings") else 2, 0, name)


def prepare_run_dir(cfg: Config) -> Path:
    """Create run.dir (clearing an old run only when run.overwrite is set and this is not a
    restart) and write config.toml."""
    run_dir = check_run_dir(cfg)
    if cfg.run.overwrite and restart_count() == 0:
        for name in ("metrics.jsonl", "events.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        for name in ("tensorboard", "final", "final-hf", "checkpoints"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    store.clean_incomplete(run_dir / "checkpoints")
    return run_dir


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drop metrics.jsonl records after ``step`` (they are recomputed after a resume), so the
    file keeps one record per step. Returns how many were dropped."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            dropped += 1
            continue
        if rec.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(x + "\n" for x in kept))
    return dropped


def train(cfg: Config, stream: TextIO | None = None) -> dict[str, Any]:
    """Run training on this rank. ``cfg`` is resolved here (again) with the process group's world size."""
    for k, v in DETERMINISTIC_ENV.items():
        if cfg.train.deterministic:
            os.environ.setdefault(k, v)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or int(os.environ.get("RANK", "0")) == 0:
        cfg = preflight(cfg, world)
    else:
        cfg = resolve(cfg, world)
    was_deterministic = torch.are_deterministic_algorithms_enabled()  # process-wide: put back at the end
    clean = False
    mesh = build_mesh(layout(cfg, world), cfg.train.device)
    try:
        resume = None
        if mesh.is_main:
            prepare_run_dir(cfg)
            if resuming(cfg) or cfg.checkpoint.load not in ("latest", "none", ""):
                path, _ = resolve_load(cfg.checkpoint.load, Path(cfg.run.dir) / "checkpoints", _event_writer(cfg))
                resume = str(path) if path else None
        if mesh.distributed:
            obj = [cfg.run.dir, cfg.train.precision, resume]
            dist.broadcast_object_list(obj, src=0)
            cfg = dataclasses.replace(
                cfg,
                run=dataclasses.replace(cfg.run, dir=obj[0]),
                train=dataclasses.replace(cfg.train, precision=obj[1]),
            )
            resume = obj[2]
        try:
            result = Trainer(cfg, mesh, stream, resume=Path(resume) if resume else None).fit()
            clean = True
            return result
        except Exception as e:
            _event_writer(cfg)("failure", rank=mesh.rank, error=f"{type(e).__name__}: {e}"[:2000])
            raise
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        shutdown(clean)


def _event_writer(cfg: Config):
    """Append one event to run.dir/events.jsonl from any rank (before or without a logger)."""

    def write(event: str, **fields: Any) -> None:
        rec = {"time": time.time(), "event": event, **fields}
        path = Path(cfg.run.dir) / "events.jsonl"
        if path.parent.is_dir():
            with path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    return write
