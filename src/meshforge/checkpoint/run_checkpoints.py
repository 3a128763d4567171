"""When to checkpoint, what a checkpoint holds, resuming from one, and the final save.

Cadence is a fixed interval or ``auto``: one save early to measure its blocking time, then
Young/Daly's optimum for checkpoint.mtbf_hours (rank 0 decides, every rank follows); with
checkpoint.final, one at the end of the run and, under wsd, one at the stable phase's end
(kept by retention: an extended run continues from it). A
checkpoint is the sharded model + optimizer (DCP), a meta.json with the train state and the
model's shape, and per-rank RNG. The final save gathers the full weights (a collective;
under pipelining each stage's ranks gather their chunks and rank 0 merges them) and writes
final/ and final-hf/. The file I/O itself lives in meshforge/checkpoint/.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshforge.checkpoint import sharded, store
from meshforge.checkpoint.memory_run import RunMemory, memory_tier
from meshforge.checkpoint.resume_point import check_shape, continuation_note
from meshforge.checkpoint.saver import CheckpointSaver, model_shape_hash, young_daly_steps
from meshforge.checkpoint.train_state import TrainState
from meshforge.checkpoint.weights import save_weights
from meshforge.config.run_plan import RunPlan
from meshforge.config.schedule import decay_start, schedule_record
from meshforge.health.fault_hooks import RunHooks
from meshforge.launch.env import restart_count
from meshforge.metrics.sinks import trim_metrics
from meshforge.models.hf import save_hf_state
from meshforge.parallel.diloco.outer import DiLoCo
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.rules import rank_layout
from meshforge.safeio.parse import read_json


def read_resume_point(run_dir: Path, resume: Path | None, is_main: bool) -> tuple[dict[str, Any] | None, int]:
    """The checkpoint's meta (None: fresh start) and, on rank 0, how many metrics.jsonl
    records after it were dropped (those steps are redone)."""
    meta = store.read_meta(resume) if resume else None
    dropped = 0
    if is_main and (meta or restart_count()):
        dropped = trim_metrics(run_dir, meta["step"] if meta else 0)
    return meta, dropped


class RunCheckpoints:
    """One per rank: owns the CheckpointSaver, the save cadence, resume and the final export."""

    def __init__(
        self,
        plan: RunPlan,
        mesh: Mesh,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        event: Callable[..., None],
        diloco: DiLoCo | None = None,
        hooks: RunHooks | None = None,
    ):
        self.plan, self.mesh, self.shape, self.event = plan, mesh, plan.shape, event
        self.diloco = diloco  # DiLoCo: outer state, and each island's own model and optimizer
        self.model, self.optimizer, self.state = model, optimizer, state
        self.run_dir = Path(plan.run.dir)
        c = plan.checkpoint
        self.checkpointer = CheckpointSaver(self.run_dir / "checkpoints", mesh, c.keep, event, hooks or RunHooks())
        self.interval = c.interval
        self.next_save = self._first_save_step()
        self.stable_end = _stable_end(plan)  # the wsd stable phase's last step, kept for extending the run
        self.checkpointer.protect = self.stable_end
        self.memory: RunMemory | None = memory_tier(plan, mesh, model, optimizer, diloco is not None)

    def _first_save_step(self) -> int | None:
        step = self.state.step
        if self.interval == 0:
            return None
        if self.interval == "young_daly":  # (checkpoint.interval = "auto") one save early, then Young/Daly
            return step + max(1, min(10, self.plan.train.steps // 10))
        return (step // self.interval + 1) * self.interval

    def meta(self) -> dict[str, Any]:
        """meta.json: the train state, the model's shape, the layout it was saved under."""
        return {
            **self.state.state_dict(),
            "model": dataclasses.asdict(self.shape),
            "model_hash": model_shape_hash(dataclasses.asdict(self.shape)),
            "world_size": self.mesh.world_size,
            "degrees": self.mesh.degrees,
            "zero_stage": self.plan.layout.zero_stage,
            "config": self.plan.to_toml(),
            "lr_schedule": schedule_record(self.plan.optim, self.plan.train.steps, self.state.step),
            "time": time.time(),
            "torch": torch.__version__,
        }

    def save(self) -> None:
        state = {**sharded.training_state(self.model, self.optimizer), "train": self.state.tensors()}
        if self.diloco:
            state = self.diloco.wrap_state(state)
        self.checkpointer.save(self.state.step, state, self.meta(), background=self.plan.checkpoint.async_)
        if self.diloco:
            self.diloco.settle()

    def maybe_save(self, last: bool, step_time_s: float) -> None:
        """Save when the cadence says so, and with checkpoint.final at the last step and at the
        end of a wsd run's stable phase."""
        due = self.next_save is not None and self.state.step >= self.next_save
        final = self.plan.checkpoint.final and (last or self.state.step == self.stable_end)
        if self.memory and self.state.step % self.memory.interval == 0 and not last:
            self.memory.snapshot_run(self.state, self.model, self.optimizer, self.event)
        if not (due or final):
            return
        self.save()
        if not due:
            return
        if self.interval != "young_daly":
            self.next_save = self._first_save_step()
            return
        blocking = self.checkpointer.last_blocking_s or 0.0
        steps, seconds = young_daly_steps(blocking, self.plan.checkpoint.mtbf_hours, step_time_s)
        if self.mesh.distributed:  # every rank must save at the same steps: rank 0 decides
            agreed = torch.tensor([steps], device=self.mesh.device)
            dist.broadcast(agreed, src=0)
            steps = int(agreed.item())
        self.event(
            "checkpoint_interval",
            steps=steps,
            seconds=round(seconds, 2),
            blocking_s=round(blocking, 4),
            mtbf_hours=self.plan.checkpoint.mtbf_hours,
            step_time_s=round(step_time_s, 4),
        )
        self.next_save = self.state.step + steps

    def resume(self, path: Path, meta: dict[str, Any], dropped: int) -> str:
        """Load model, optimizer and train state from ``path`` (any layout: DCP reshards);
        returns the line to print."""
        check_shape(meta, self.shape, path)  # (the pre-flight checked it before anything was written)
        t0 = time.perf_counter()
        saved = self.state.tensors() if store.holds_train_state(path) else None  # filled in by the load
        extra = {"train": saved} if saved else None
        wrap = self.diloco.wrap_state if self.diloco else None
        sharded.load(self.model, self.optimizer, path, wrap=wrap, extra=extra)
        if self.diloco:
            self.diloco.settle()
        self.state.load_state_dict(meta)
        if saved:
            self.state.check_tensors(saved, path / "meta.json")
        same_layout = meta["world_size"] == self.mesh.world_size and meta["degrees"] == self.mesh.degrees
        rank_file = path / f"rank-{self.mesh.rank:05d}.json"
        if same_layout and rank_file.exists():
            self.state.load_rng_state(read_json(rank_file, store.CheckpointError)["rng"])  # (checked by verify)
        self.next_save = self._first_save_step()
        self.event(
            "resumed",
            source="disk",
            path=str(path),
            step=self.state.step,
            saved_layout=meta["degrees"],
            layout=self.mesh.degrees,
            resharded=not same_layout,
            load_s=round(time.perf_counter() - t0, 4),
            metrics_dropped=dropped,
        )
        note = continuation_note(meta, self.plan)
        if note:
            self.event("schedule_continued", step=self.state.step, message=note)
        return (
            f"resumed from {path} at step {self.state.step}"
            + (f" (saved on {meta['world_size']} ranks {meta['degrees']}, resharded)" if not same_layout else "")
            + (f"\n{note}" if note else "")
        )

    def resume_memory(self, disk: Path | None) -> str | None:
        """Load the newest memory checkpoint every rank can fetch, when no older than ``disk`` (a
        collective); returns the line to print, or None: nothing usable in memory, resume from disk."""
        if self.memory is None or self.plan.checkpoint.load == "none":
            return None
        step = self.memory.restore(self.state, self.model, self.optimizer, self.event, disk)
        if step is None:
            return None
        self.next_save = self._first_save_step()
        return f"resumed from memory at step {step}"

    def export_final(self, pipelined: bool) -> None:
        """Gather the full weights (a collective under sharding: every rank calls) and let
        rank 0 write final/ and final-hf/ as configured."""
        c = self.plan.checkpoint
        if not (c.save_final or c.export_hf):
            return
        # gathering TP x FSDP shards takes two all-gathers per tensor, which DTensor warns
        # about per tensor; for a one-off save that is fine
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            state = self._pipeline_full_state() if pipelined else self._full_state()
        finally:
            quiet.setLevel(level)
        if not self.mesh.is_main:
            return
        if c.save_final:
            path = save_weights(self.shape, state, self.run_dir / "final")
            self.event("final_weights", path=str(path), step=self.state.step)
        if c.export_hf:
            path = save_hf_state(self.shape, state, self.run_dir / "final-hf")
            self.event("export_hf", path=str(path), step=self.state.step)

    def _full_state(self) -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, on the CPU
        if hasattr(self.optimizer, "full_training_state"):  # bf16 ZeRO-1: the fp32 master, not the bf16 copy
            return {k: v.cpu() for k, v in self.optimizer.full_training_state(self.model)["model"].items()}
        return get_model_state_dict(self.model, options=opts)

    def _pipeline_full_state(self) -> dict[str, torch.Tensor] | None:
        """Every pipeline rank gathers its chunks' full weights (over dp and tp), then the
        ranks at dp = tp = 0 send theirs along the pp axis to rank 0, which merges them."""
        opts = StateDictOptions(full_state_dict=True)
        local = {k: v.detach().cpu() for k, v in get_model_state_dict(self.model, options=opts).items()}
        coords = rank_layout(self.mesh.degrees)[self.mesh.rank]
        if any(v for k, v in coords.items() if k not in ("pp", "rank")):
            return None
        parts: list | None = [None] * self.plan.layout.pp if self.mesh.is_main else None
        dist.gather_object(local, parts, dst=0, group=self.mesh.group("pp"))
        if not self.mesh.is_main:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: _param_order(kv[0])))


def _stable_end(plan: RunPlan) -> int | None:
    """The step count at which a wsd run's decay begins, when checkpoint.final keeps a checkpoint there."""
    if plan.optim.schedule != "wsd" or not plan.checkpoint.final:
        return None
    start = decay_start(plan.optim, plan.train.steps)
    return start if 0 < start < plan.train.steps else None


def _param_order(name: str) -> tuple:
    """The whole model's parameter order: embedding, blocks by index, norm, head."""
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("tok_embeddings") else 2, 0, name)
