"""The memory tier in a run: what a snapshot holds (the disk checkpoint's tensors, the train state and
the rank's RNG), and a restart's load from memory with its events (``memory_checkpoint``,
``memory_checkpoint_failed``, ``memory_checkpoint_unused``, ``resumed`` with ``source = "memory"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshforge.checkpoint import sharded, store
from meshforge.checkpoint.memory_frame import MemoryShardError
from meshforge.checkpoint.memory_tier import Found, MemoryTier, flatten, gather
from meshforge.checkpoint.memory_wire import check_against
from meshforge.checkpoint.saver import rng_state, set_rng_state
from meshforge.checkpoint.train_state import TrainState
from meshforge.checkpoint.validate import CheckpointError
from meshforge.config.run_plan import RunPlan
from meshforge.launch import env as launch_env
from meshforge.metrics.sinks import trim_metrics
from meshforge.parallel.mesh import Mesh

Event = Callable[..., None]


def replicated(plan: RunPlan, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether every rank holds the whole training state (plain data parallelism): then any rank's
    shard restores any rank, in any world size."""
    lay = plan.layout
    if hasattr(optimizer, "full_training_state") or type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        return False
    return lay.pp == 1 and lay.ep == 1 and not any(hasattr(p, "to_local") for p in model.parameters())


def memory_tier(
    plan: RunPlan, mesh: Mesh, model: nn.Module, optimizer: torch.optim.Optimizer, diloco: bool
) -> RunMemory | None:
    """The run's memory tier when checkpoint.memory_interval asks for one and a launcher can restart ranks."""
    if not plan.checkpoint.memory_interval or diloco or not launch_env.under_launcher():
        return None
    layout = {"world_size": mesh.world_size, "degrees": mesh.degrees, "replicated": replicated(plan, model, optimizer)}
    return RunMemory(Path(plan.run.dir), mesh.rank, layout, plan.checkpoint.memory_interval)


class RunMemory(MemoryTier):
    """The memory tier with the run's state: snapshots and restores."""

    def snapshot_run(self, state: TrainState, model: nn.Module, optimizer: torch.optim.Optimizer, event: Event) -> None:
        self.wait()
        if self.failures:
            event("memory_checkpoint_failed", level="warning", step=state.step, message=self.failures[-1][:500])
            self.failures.clear()
        tree = {**sharded.training_state(model, optimizer), "train": state.tensors()}
        info = {"train": state.state_dict(), "rng": rng_state()}
        event("memory_checkpoint", **self.snapshot(state.step, tree, info))

    def restore(
        self, state: TrainState, model: nn.Module, optimizer: torch.optim.Optimizer, event: Event, disk: Path | None
    ) -> int | None:
        """Load the newest usable memory checkpoint (collective); its step, or None (then disk)."""
        disk_step = int(store.read_meta(disk)["step"]) if disk else None
        t0 = time.perf_counter()
        found, err = self.find(disk_step)
        if found is not None:  # (find's verdict is every rank's)
            try:
                self._load(found, state, model, optimizer)
            except (CheckpointError, MemoryShardError, KeyError, TypeError, ValueError) as e:
                err = str(e)
            err = "; ".join(e for e in gather(err) if e)
        if found is None or err:
            if launch_env.restart_count() or self.held_any:  # (a first start with empty keepers says nothing)
                to = str(disk) if disk else "a fresh start"
                event("memory_checkpoint_unused", level="warning", reason=err[:2000], fallback=to)
            self.trim(disk_step or 0)
            return None
        self.trim(found.step)
        dropped = trim_metrics(self.dir.parent, found.step) if self.rank == 0 else 0
        event(
            "resumed",
            source="memory",
            step=found.step,
            hosts=found.hosts,
            from_peer=found.peers,
            disk_step=disk_step,
            layout=self.layout["degrees"],
            load_s=round(time.perf_counter() - t0, 4),
            metrics_dropped=dropped,
        )
        return found.step

    def _load(self, found: Found, state: TrainState, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        saved = state.tensors()
        sharded.load(model, optimizer, Path("memory"), extra={"train": saved}, fill=lambda t: self._fill(t, found))
        state.load_state_dict(found.info["train"])
        state.check_tensors(saved, Path(f"memory step {found.step}"))
        if found.own:
            set_rng_state(found.info["rng"])

    def _fill(self, tree: dict[str, Any], found: Found) -> None:
        """Check the fetched shard against this rank's tensors on every rank, then copy it in."""
        want = flatten(tree)
        try:
            check_against(found.tensors, want, f"rank {self.rank}'s step-{found.step} shard from {found.host}")
            err = None
        except MemoryShardError as e:
            err = str(e)
        errors = [e for e in gather(err) if e]
        if errors:
            raise MemoryShardError("; ".join(errors))
        with torch.no_grad():
            for k, t in want.items():
                t.copy_(found.tensors[k])
