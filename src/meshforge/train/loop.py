"""One rank's run, from the plan its launch accepted to the last step: ``train(plan)`` joins
the process group, agrees with the other ranks where the run starts, and runs the ``Trainer``.

The Trainer holds the run's parts and gives each, by name, only what it needs: the model
(parallel/parallelize.py's ``build_rank_model``; model.init_from loaded over it), the loss
and what wraps a forward (built once, shared by the step runner and the evaluator), the
optimizer and LR schedule (optimizer.py), the train state (checkpoint/train_state.py), the
step runner (step.py), the evaluator (evaluate.py), checkpoints
(checkpoint/run_checkpoints.py), the run log (run_log.py: events, console, records, summary),
what a measured step gathers (step_stats.py), the health keeper (health/keeper.py), the
profiler and step clock (metrics/instruments.py), and the run's hooks, where fault injection
attaches (health/fault_hooks.py, health/faults.py). A step is *measured* (syncs, collectives,
comm counting) only when logged, last, or drawn as a Gantt chart; see docs/metrics.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from meshforge.checkpoint import store
from meshforge.checkpoint.resume_point import find_resume_point
from meshforge.checkpoint.run_checkpoints import RunCheckpoints, read_resume_point
from meshforge.checkpoint.train_state import TrainState
from meshforge.checkpoint.weights import load_pretrained_into
from meshforge.config.run_plan import RunPlan
from meshforge.data.corpus import open_data, separator_warning
from meshforge.data.dataset import TokenDataset
from meshforge.data.sampler import GlobalBatchSampler
from meshforge.guards.preflight import resuming
from meshforge.health import faults
from meshforge.health.fault_hooks import RunHooks
from meshforge.health.flight_recorder import ENV as FLIGHT_RECORDER_ENV
from meshforge.health.keeper import HealthKeeper
from meshforge.launch import env as launch_env
from meshforge.launch import startup_gc
from meshforge.metrics.instruments import StepInstruments
from meshforge.metrics.logged_steps import is_logged
from meshforge.metrics.step_result import StepResult
from meshforge.parallel.diloco.outer import build_diloco
from meshforge.parallel.fault_tolerance.replicas import LighthouseLost, build_replicas
from meshforge.parallel.mesh import Mesh, build_mesh, shutdown
from meshforge.parallel.parallelize import build_loss, build_rank_model, forward_context
from meshforge.train.evaluate import Evaluator
from meshforge.train.failure import on_failure
from meshforge.train.moe_stats import install_step_hook
from meshforge.train.optimizer import build_optimizer, build_scheduler
from meshforge.train.rollback import roll_back
from meshforge.train.run_dir import event_writer
from meshforge.train.run_log import RunLog
from meshforge.train.step import PipelineStep, PlainStep
from meshforge.train.step_stats import StepMeasures
from meshforge.train.stop import StopRequest

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def train(plan: RunPlan, stream: TextIO | None = None) -> dict[str, Any]:
    """Run training on this rank; ``plan`` is the launch's verdict (guards/preflight.py), never
    resolved or checked again here. Returns the run's summary."""
    if not isinstance(plan, RunPlan):
        raise TypeError(
            f"train takes the run plan the pre-flight accepted (guards/preflight.py), not {type(plan).__name__}"
        )
    if plan.train.deterministic:  # (before the process group starts, as the flight recorder's)
        for k, v in DETERMINISTIC_ENV.items():
            os.environ.setdefault(k, v)
    os.environ.setdefault(*FLIGHT_RECORDER_ENV)  # the hang watchdog reads it
    was_deterministic = torch.are_deterministic_algorithms_enabled()  # process-wide: put back at the end
    clean = False
    mesh = build_mesh(plan.layout, plan.train.device, cpu_backend=plan.layout.offload == "cpu")
    try:
        plan, resume = agree_on_start(plan, mesh)
        try:
            result = Trainer(plan, mesh, stream, resume=Path(resume) if resume else None).fit()
            clean = True
            return result
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            instead = on_failure(plan, mesh.rank, mesh.world_size, e)
            if instead is not None:
                raise instead from None
            raise
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        shutdown(clean)


def agree_on_start(plan: RunPlan, mesh: Mesh) -> tuple[RunPlan, str | None]:
    """Rank 0 knows where the run starts: run.dir and the checkpoint its pre-flight picked for this
    elastic attempt (a later attempt looks again: the failed one may have saved since); it clears
    what a save cut short left, names the checkpoints passed over, and every rank gets both."""
    resume = None
    if mesh.is_main:
        store.clean_incomplete(Path(plan.run.dir) / "checkpoints")
        point = plan.resume
        if point is None or point.attempt != launch_env.restart_count():
            point = find_resume_point(plan, resuming(plan), len(open_data(plan, plan.shape).train))
        for path, why in point.skipped:
            event_writer(plan.run.dir)("checkpoint_skipped", level="warning", path=path, reason=why)
        resume = point.path
    if not mesh.distributed:
        return plan, resume
    obj = [plan.run.dir, resume]  # (under plain torchrun only rank 0's pre-flight picked run.dir)
    dist.broadcast_object_list(obj, src=0)
    return plan.with_run_dir(obj[0]), obj[1]


def open_data_in_turn(plan: RunPlan, mesh: Mesh) -> TokenDataset:
    """The corpus's token shards: rank 0 prepares (or reuses) them first, the others then read them."""
    if mesh.distributed and not mesh.is_main:
        dist.barrier()
    data = open_data(plan, plan.shape)
    if mesh.distributed and mesh.is_main:
        dist.barrier()
    return data


class Trainer:
    """One rank's training run: the parts, and the loop over them."""

    def __init__(self, plan: RunPlan, mesh: Mesh, stream: TextIO | None = None, resume: Path | None = None):
        """``plan``: the launch's verdict, with the run.dir the ranks agreed on; ``mesh``: its layout's groups."""
        self.plan, self.mesh = plan, mesh
        t = plan.train
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(t.seed)
        self.data = open_data_in_turn(plan, mesh)
        self.loss = build_loss(plan)
        self.forward = forward_context(plan, mesh.device)  # what wraps a forward: the step's and evaluation's
        built = build_rank_model(plan, mesh, self.loss)
        self.model, self.pipeline = built.model, built.pipeline
        if plan.model.init_from:
            load_pretrained_into(self.model, plan.shape, plan.model.init_from)
        self.optimizer = build_optimizer(self.model, plan, mesh)
        install_step_hook(self.optimizer, self.model, self.loss, mesh)  # MoE balance bias, the step's loss parts
        self.diloco = build_diloco(
            plan.diloco, plan.layout.islands, plan.shape.layers, mesh, self.model, self.optimizer
        )
        sampler = GlobalBatchSampler(len(self.data.train), t.global_batch_size, t.seed)
        self.state = TrainState(sampler, t.global_batch_size * t.seq_len)
        self.log = RunLog(plan, mesh, stream)
        if mesh.is_main and (line := separator_warning(plan, self.data)):  # once, before anything trains
            self.log.event("warning", key="data.document_mask", message=line)
            self.log.say(f"warning: {line}")
        self.hooks = RunHooks()
        self.checkpoints = RunCheckpoints(
            plan,
            mesh,
            model=self.model,
            optimizer=self.optimizer,
            state=self.state,
            event=self.log.event,
            diloco=self.diloco,
            hooks=self.hooks,
        )
        self._resume(resume)
        self.replicas = build_replicas(plan, mesh, self.model, self.optimizer, self.state, len(self.data.train))
        self.scheduler = build_scheduler(self.optimizer, plan, self.state.step)
        self.runner = self._runner(built.train_model)
        self.runner.replicas = self.replicas
        if self.replicas:  # a group that heals inside a step takes the LR schedule at the healed step
            self.replicas.on_heal = self.reposition_schedule
        self._watch()

    def _watch(self) -> None:
        """The evaluator and what watches the steps: measures, health, instruments, fault hooks."""
        plan, mesh, log = self.plan, self.mesh, self.log
        self.evaluate = Evaluator(
            self.data.val,
            plan,
            mesh,
            model=self.model,
            loss=self.loss,
            forward_context=self.forward,
            pipeline=self.pipeline,
            packing=self.runner.packing,
        )
        model, loss, pipeline, reduce_loss = self.model, self.loss, self.pipeline, self.runner.reduce_loss
        self.measures = StepMeasures(
            plan, mesh, model=model, loss=loss, pipeline=pipeline, reduce_loss=reduce_loss, event=log.event
        )
        called = list(self.pipeline.parts) if self.pipeline else [self.model]  # the modules a forward calls
        self.health = HealthKeeper(
            plan,
            mesh,
            runner=self.runner,
            model=self.model,
            called=called,
            event=log.event,
            say=log.say,
            hooks=self.hooks,
            samples=self._samples_before,
            across=self.replicas.fingerprints if self.replicas else None,
        )
        self.instruments = StepInstruments(
            plan,
            mesh,
            first_forward=_first_forward(self.model, self.pipeline),
            optimizer=self.optimizer,
            comm=self.measures.comm,
            logger=log.logger,
            metrics=log.metrics,
            event=log.event,
            say=log.say,
        )
        faults.attach(self.hooks, mesh.rank, called)

    def _resume(self, resume: Path | None) -> None:
        """Load the checkpoint to resume from (if any) and say where the run starts."""
        where = {"world_size": self.mesh.world_size, "resume_from": str(resume) if resume else None}
        if launch_env.restart_count():
            self.log.event("restart", attempt=launch_env.restart_count(), **where)
        self.log.event("world", attempt=launch_env.restart_count(), **where)  # each (re)start: elastic change points
        line = self.checkpoints.resume_memory(resume)  # (checkpoint.memory_interval: newer than disk, or None)
        if line is None:
            meta, dropped = read_resume_point(Path(self.plan.run.dir), resume, self.mesh.is_main)
            line = self.checkpoints.resume(resume, meta, dropped) if resume else None
        if line:
            self.log.say(line)

    def _runner(self, train_model: torch.nn.Module) -> PlainStep | PipelineStep:
        common = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "loss": self.loss}
        common["eos_id"] = self.data.eos_id
        if self.pipeline:
            return PipelineStep(self.plan, self.mesh, pipeline=self.pipeline, **common)
        return PlainStep(self.plan, self.mesh, train_model=train_model, forward_context=self.forward, **common)

    def _samples_before(self, lag: int) -> list[int]:
        """The sample indices of the batch ``lag`` steps before the last one taken (for spike events)."""
        sampler = self.state.sampler
        return sampler.indices(sampler.consumed - (1 + lag) * sampler.batch, sampler.batch).tolist()

    def step_once(self, measure: bool = True) -> StepResult:
        """Fetch this rank's slice of the next global batch and take one step. ``measure``:
        also take what a logged step reports (the same on every rank: it adds collectives)."""
        lay = self.plan.layout  # a replica group reads its own slice (fault tolerance)
        rank = self.mesh.data_rank + (self.replicas.replica_id * lay.islands * lay.dp if self.replicas else 0)
        idx = self.state.sampler.next_batch(rank, lay.data_ranks)
        host = self.data.train.get(idx)
        documents = self.runner.packing.documents(host)  # read from the host tokens: no device sync
        batch = host.to(self.mesh.device, non_blocking=True)
        if self.diloco:
            warm = self.diloco.in_warmup(self.state.step + 1)
            self.runner.pre_update = self.diloco.average_grads if warm else None
        with self.measures.counting(measure):
            result = self.runner.run(batch, measure, documents)
            if self.diloco:  # the outer sync (counted on the "island" axis)
                self.diloco.after_step(self.state.step + 1)
        if not result.committed:  # the replica groups take this step again, on the same batch
            self.state.sampler.consumed -= self.state.sampler.batch
            return result
        self.measures.add_span(result.attention_span)
        extra = self.measures.take() if measure else None
        self.state.advance()
        if extra is not None:
            self.measures.gantt(self.state.step)
        return result

    def fit(self) -> dict[str, Any]:
        """Train to train.steps (or a stop request); returns the summary."""
        startup_gc.resume()  # (paused while the process started: launch/startup_gc.py)
        try:
            with StopRequest(self.mesh, self.log.say) as stop:
                result = self._fit(stop)
            self.checkpoints.checkpointer.close()
            return result
        except BaseException:
            self.checkpoints.checkpointer.abandon()
            raise
        finally:
            self.log.close()

    def _fit(self, stop: StopRequest) -> dict[str, Any]:
        t, st = self.plan.train, self.state
        if st.step >= t.steps:  # resumed from a checkpoint at (or past) the end
            self.log.event("nothing_to_do", step=st.step, steps=t.steps)
            self.log.say(f"already trained to step {st.step} (train.steps = {t.steps}); raise train.steps to continue")
            return {"steps": st.step, "interrupted": False, "tokens": st.tokens_seen, "already_done": True}
        self.log.announce(self.model, self.data)
        interrupted, t_start, start = False, time.perf_counter(), st.step
        while st.step < t.steps:
            if self.replicas:
                self._join_quorum()
            n = st.step + 1
            logged = is_logged(n, self.plan.metrics.log_interval, t.steps)
            last = n == t.steps or stop.stop_after(n, logged)
            if not self._one_step(n, logged, last):  # went back to a checkpoint
                continue
            if t.eval_interval and n % t.eval_interval == 0 and not last:
                self._evaluate_and_log()
            if last and n < t.steps:
                interrupted = True
                self.log.event("interrupted", step=n)
                break
        if self.replicas:
            self.replicas.close(self.log.event)
        self.health.close()
        self.instruments.close()
        with self.log.phases("checkpoint"):
            self.checkpoints.checkpointer.wait()
        val_loss = self._evaluate_and_log() if t.eval_batches else None
        return self._finish(interrupted, time.perf_counter() - t_start, val_loss, start)

    def _one_step(self, n: int, logged: bool, last: bool) -> bool:
        """Step ``n`` with its watchers, record and checkpoint; False when it rolled back instead."""
        self.health.before_step(n, logged)
        self.hooks.run_before(n)
        t0 = time.perf_counter()
        self.instruments.before_step(n, t0, measured=logged)
        result = self.step_once(measure=self.measures.wanted(n, logged, last))
        if not result.committed:
            return False
        if self.state.step != n:  # this replica group healed inside the step: it took its peer's step
            n = self.state.step
            last = last or n == self.plan.train.steps
        if self.replicas:
            self.replicas.committed(n, self.log.event)
        self.instruments.after_step(n)
        if self.health.after_step(n):
            self.health.guard.pending = []  # steps about to be undone
            log = {"event": self.log.event, "say": self.log.say}
            roll_back(n, self.checkpoints, self.state, self.mesh, **log, redo=self.health.redo)
            self.reposition_schedule()
            return False
        self.hooks.run_after(self.state.step)
        dt = time.perf_counter() - t0
        with self.log.phases("logging"):
            extra = self.measures.extra if (logged or last) else None
            self.log.step(n, result, self.state.tokens_seen, dt, extra)
        with self.log.phases("checkpoint"):
            self.checkpoints.checkpointer.poll()
            if self.replicas is None or self.replicas.writes_checkpoints():  # one replica group writes them
                self.checkpoints.maybe_save(last, self.log.metrics.recent_step_time())
        return True

    def _join_quorum(self) -> None:
        """Ask for the replica groups' quorum of the next step (answered in the background; a group that
        must heal does so inside the step). A lost lighthouse: save here to resume from, then stop."""
        try:
            self.replicas.begin(self.log.event)
        except LighthouseLost as e:
            self.log.event("lighthouse_lost", step=self.state.step, message=str(e))
            self.checkpoints.save()
            self.checkpoints.checkpointer.wait()
            raise

    def reposition_schedule(self) -> None:
        """The LR schedule at the current step (after a rollback loaded an older checkpoint, or a replica
        group healed from a peer)."""
        self.scheduler = self.runner.scheduler = build_scheduler(self.optimizer, self.plan, self.state.step)

    def _evaluate_and_log(self) -> float | None:
        with self.log.phases("eval"):
            v = self.evaluate()
        self.log.evaluation(self.state.step, v)
        return v

    def _finish(self, interrupted: bool, wall: float, val_loss: float | None, start: int) -> dict[str, Any]:
        """The summary (a collective), the final weights, then the last lines. ``start``: the step this
        process resumed at (0 for a fresh run): the wall time and tokens/s are this session's."""
        st = self.state
        fields = {"steps": st.step, "start_step": start, "tokens": st.tokens_seen, "val_loss": val_loss}
        summary = self.log.summary(self.runner.reduce_loss, interrupted, wall, **fields)
        self.checkpoints.export_final(pipelined=self.pipeline is not None)
        self.log.finish(summary)
        return summary


def _first_forward(model: torch.nn.Module, pipe: Any) -> list[torch.nn.Module]:
    """Where a step's data time ends: the model's forward, or under pp the first stage's part
    (a later stage's first forward waits for the pipeline to fill: that is bubble, not data)."""
    if pipe is None:
        return [model]
    return [pipe.parts[pipe.chunks.index(0)]] if pipe.has_first else []
