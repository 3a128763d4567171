"""The trainer's health part: wires the step guard into the runner, reports what it found
(one event and one console warning on rank 0), and acts on it: skip (already done by the
guard), stop, or roll back to the last complete checkpoint and skip the batches since.
The detectors themselves live in meshforge/health/.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshforge import faults
from meshforge.checkpoint import store
from meshforge.checkpoint.saver import resolve_load
from meshforge.errors import MeshforgeError
from meshforge.health.guard import StepGuard
from meshforge.health.straggler import StragglerCheck
from meshforge.health.text_check import not_text_files
from meshforge.health.trainer_view import TrainerView
from meshforge.health.watchdog import HangWatchdog
from meshforge.metrics.progress import is_logged
from meshforge.metrics.sinks import trim_metrics


class HealthStop(MeshforgeError):
    """The run was stopped by a health check (health.on_nonfinite = stop, or too many bad steps)."""

    every_rank = True  # the guard's verdict is agreed: every rank stops at the same step


def describe(v: dict[str, Any]) -> str:
    """The one console line for a health event: what happened and what was done."""
    done = {"skip": "skipped the update", "stop": "stopping the run", "rollback": "rolling back", "log": "logged"}
    if v["event"] == "nonfinite":
        what = f"non-finite {' and '.join(v['where'])} at step {v['step']} on rank(s) {v['ranks']}"
        if v.get("param"):
            what += f" (first in {v['param']} on rank {v['param_rank']})"
    elif v["event"] == "loss_spike":
        what = f"loss spike at step {v['step']}: {v['loss']:.4g} is {v['score']} deviations above {v['median']:.4g}"
    elif v["event"] == "straggler":
        what = f"straggler: rank {v['rank']} on {v['host']} computes {v['ratio']}x slower than the median rank"
    else:
        what = v["event"]
    return f"warning: {what}; {done.get(v.get('action', ''), v.get('action', ''))}" + (
        f" ({v['reason']})" if v.get("reason") else ""
    )


class HealthKeeper:
    """One per rank: before_step / after_step around every step."""

    def __init__(self, trainer: TrainerView):
        self.t = trainer
        mesh = trainer.mesh
        # the modules forward actually calls: under pp the stages' parts, not the model view
        self.called = list(trainer.pipeline.parts) if trainer.pipeline is not None else [trainer.model]
        h = trainer.cfg.health
        self.guard = StepGuard(h, trainer.model, mesh.rank, mesh.distributed, trainer.runner.reduce_loss)
        self.guard.forward_module = self.called[-1]
        trainer.runner.guard = self.guard
        self.watchdog = None
        if mesh.distributed and trainer.cfg.health.hang_timeout_s > 0:
            axes = {g.group_name: axis for g, axis in mesh.groups_by_axis().items()}
            run_dir = Path(trainer.cfg.run.dir)
            self.watchdog = HangWatchdog(trainer.cfg.health.hang_timeout_s, mesh.rank, mesh.world_size, axes, run_dir)
            self.watchdog.start()
        self.stragglers = None
        if mesh.distributed and h.straggler_factor > 0:
            self.stragglers = StragglerCheck(h.straggler_factor, mesh.rank, mesh.world_size, mesh.device)
        self.logged, self.compute_s, self._t0 = False, 0.0, 0.0
        self.slow = faults.slow_factor(mesh.rank)
        self.hooks: list[Any] = []
        self.pause(False)
        if mesh.is_main and trainer.cfg.data.tokenizer == "byte":
            self._warn_if_not_text(h.text_warn_fraction)

    def pause(self, paused: bool) -> None:
        """Take the per-step checks out (guard, forward timing) or put them back; for the
        overhead benchmark, which compares both in one run."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.t.runner.guard = None if paused else self.guard
        if not paused:
            for m in self.called:
                self.hooks.append(m.register_forward_pre_hook(self._forward_starts))
                self.hooks.append(m.register_forward_hook(self._forward_ends))

    def _forward_starts(self, *_: Any) -> None:
        if self.logged and self.t.device.type == "cuda":
            torch.cuda.synchronize(self.t.device)
        self._t0 = time.perf_counter()

    def _forward_ends(self, *_: Any) -> None:
        if self.logged and self.t.device.type == "cuda":
            torch.cuda.synchronize(self.t.device)
        dt = time.perf_counter() - self._t0
        if self.slow > 1:  # injected straggler (tests)
            time.sleep(dt * (self.slow - 1))
            dt *= self.slow
        self.compute_s += dt

    def _warn_if_not_text(self, threshold: float) -> None:
        bad = not_text_files(self.t.cfg.data.path, threshold)
        if bad:
            f, share = bad[0]
            more = f" and {len(bad) - 1} more file(s)" if len(bad) > 1 else ""
            self.t.event("data_not_text", files={str(p): round(s, 4) for p, s in bad[:20]}, threshold=threshold)
            self.t.say(
                f"warning: data.path {f}{more} does not look like text: {share:.0%} of its bytes are not valid "
                "UTF-8, yet the byte tokenizer trains on them; check data.path"
            )

    def close(self) -> None:
        """The loop is over: later phases (final evaluation, export) are not watched."""
        if self.watchdog:
            self.watchdog.stop()

    def before_step(self, n: int) -> float:
        """Note that step ``n`` starts; returns its start time (perf_counter)."""
        self.guard.arm(n)
        cfg = self.t.cfg
        self.logged = is_logged(n, cfg.metrics.log_interval, cfg.train.steps)
        self.compute_s = 0.0
        if self.watchdog:
            self.watchdog.beat(n)
        faults.maybe_hang(self.t.mesh.rank, n)
        return time.perf_counter()

    def after_step(self, n: int) -> bool:
        """Report and act on the guard's verdict for step ``n``; True when the run went back
        to a checkpoint (the loop goes on from there)."""
        if self.stragglers and self.logged and (n > 1 or self.t.cfg.metrics.log_interval == 1):  # step 1: warm-up
            for found in self.stragglers.check(self.compute_s, n):
                self.report({"event": "straggler", "action": "log", **found})
        late, self.guard.late = self.guard.late, []
        for v in late:  # logged spikes of earlier steps, judged now: their batches are further back
            self.report(self._with_samples(v))
        v, self.guard.verdict = self.guard.verdict, None
        if v is None:
            return False
        self.report(self._with_samples(v) if v["event"] == "loss_spike" else v)
        if v["action"] == "stop":
            events = Path(self.t.cfg.run.dir) / "events.jsonl"
            raise HealthStop(describe(v).removeprefix("warning: ") + f"; see {events}")
        if v["action"] == "rollback":
            self.roll_back(n)
            return True
        return False

    def _with_samples(self, v: dict[str, Any]) -> dict[str, Any]:
        """A spike's event names its batch's sample indices (``lag`` steps before the current one)."""
        sampler = self.t.state.sampler
        start = sampler.consumed - (1 + v.pop("lag", 0)) * sampler.batch
        return {**v, "samples": sampler.indices(start, sampler.batch).tolist()}

    def report(self, v: dict[str, Any]) -> None:
        self.t.event(v["event"], **{k: x for k, x in v.items() if k != "event"})
        self.t.say(describe(v))

    def roll_back(self, bad_step: int) -> None:
        """Load the newest complete checkpoint (every rank: a collective), then move the data
        order past the bad step's batch: the batches in between are skipped (PaLM's recipe)."""
        t = self.t
        t.checkpoints.checkpointer.wait()
        self.guard.pending = []  # steps about to be undone
        consumed = t.state.sampler.consumed  # just past the bad batch
        root = Path(t.cfg.run.dir) / "checkpoints"
        found = [str(resolve_load("latest", root, t.event)[0] or "")] if t.mesh.is_main else [""]
        if t.mesh.distributed:
            dist.broadcast_object_list(found, src=0)
        if not found[0]:
            raise HealthStop(f"step {bad_step} asks for a rollback but {root} has no complete checkpoint yet")
        path = Path(found[0])
        meta = store.read_meta(path)
        dropped = trim_metrics(Path(t.cfg.run.dir), meta["step"]) if t.mesh.is_main else 0
        t.say(t.checkpoints.resume(path, meta, dropped))
        skipped = consumed // t.state.sampler.batch - meta["sampler"]["consumed"] // t.state.sampler.batch
        t.state.sampler.consumed = consumed
        t.reposition_schedule()
        t.event("rollback", bad_step=bad_step, to_step=t.state.step, path=str(path), batches_skipped=skipped)
