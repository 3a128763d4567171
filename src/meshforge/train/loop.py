"""The training loop: one rank's Trainer ties the parts together, ``train`` runs it.

Parts: train state (state.py), optimizer and LR schedule (optimizer.py), the step runner
(step.py), the evaluator (evaluate.py), checkpoints (checkpoint/run_checkpoints.py), step
records and the run's announcements (metrics/), the run directory (run_dir.py). A step is
*measured* (syncs, collectives, comm counting) only when logged, last, or the pipeline
step drawn as a Gantt chart; see docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from meshforge import faults, launch_env, run_lock
from meshforge.checkpoint.run_checkpoints import RunCheckpoints, read_resume_point
from meshforge.config import Config
from meshforge.data.sampler import GlobalBatchSampler
from meshforge.health.step_watch import StepWatch
from meshforge.metrics.mfu import peak_flops
from meshforge.metrics.progress import is_logged
from meshforge.metrics.sinks import MetricsLogger
from meshforge.metrics.step_metrics import StepMetrics
from meshforge.metrics.time_breakdown import PhaseTimer
from meshforge.parallel.comm_stats import CommCounter
from meshforge.parallel.diloco.outer import build_diloco
from meshforge.parallel.mesh import Mesh, build_mesh, shutdown
from meshforge.parallel.parallelize import build_loss, forward_context
from meshforge.run_plan import RunPlan
from meshforge.train.evaluate import Evaluator
from meshforge.train.failure import on_failure
from meshforge.train.model_setup import build_rank_model
from meshforge.train.moe_stats import install_step_hook, moe_record
from meshforge.train.optimizer import build_optimizer, build_scheduler
from meshforge.train.pipeline_stats import gather_pipeline_stats, write_gantt
from meshforge.train.run_dir import agree_on_start, launch_plan, open_data
from meshforge.train.run_records import announce, finish_run, log_step
from meshforge.train.state import TrainState
from meshforge.train.step import PipelineStep, PlainStep, StepResult
from meshforge.train.stop import StopRequest


class Trainer:
    """One rank's training run: the parts, and the loop over them."""

    def __init__(self, plan: RunPlan, mesh: Mesh, stream: TextIO | None = None, resume: Path | None = None):
        """``plan`` is the run resolved once per launch by ``train``; ``mesh`` is built from its layout."""
        cfg = plan
        self.cfg, self.plan, self.mesh, self.device = plan, plan, mesh, mesh.device
        self.args = plan.shape
        t = plan.train
        self.precision = t.precision
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(t.seed)
        if mesh.distributed and not mesh.is_main:
            dist.barrier()  # let rank 0 build the data cache first
        self.data = open_data(cfg, self.args)
        if mesh.distributed and mesh.is_main:
            dist.barrier()
        self.loss = build_loss(plan)
        built = build_rank_model(plan, mesh, self.loss)
        self.model, self.pipeline = built.model, built.pipeline
        self.optimizer = build_optimizer(self.model, cfg, mesh)
        install_step_hook(self.optimizer, self.model, self.loss, mesh)  # MoE balance bias, the step's loss parts
        self.diloco = build_diloco(plan.diloco, plan.shape.layers, mesh, self.model, self.optimizer)  # islands > 1
        sampler = GlobalBatchSampler(len(self.data.train), t.global_batch_size, t.seed)
        self.state = TrainState(sampler, t.global_batch_size * t.seq_len)
        self.local_batch = plan.local_batch  # DiLoCo islands take their own slices
        self.micro = plan.layout.micro_batch_size
        self.accum = 1 if self.pipeline else plan.microbatches  # the pipeline schedule runs its micro-batches
        self.comm = CommCounter(mesh.groups_by_axis()) if mesh.distributed else None
        self.state_mem: dict[str, int] = {}  # the last measured step's figures
        self.comm_bytes: dict[str, dict[str, float]] = {}
        self.pp_stats: dict[str, Any] = {}
        self.moe_stats: dict[str, Any] = {}
        self.gantt_step = min(3, t.steps) if self.pipeline else 0  # past the first steps' warm-up
        self.peak = peak_flops(self.device, self.precision)
        self.metrics = StepMetrics(cfg, self.args, mesh.world_size, self.peak, self.device)
        self.phases = PhaseTimer()  # host time of checkpoint, eval and logging (time_breakdown)
        self._start_run(stream, resume, built.train_model)

    def _start_run(self, stream: TextIO | None, resume: Path | None, train_model: torch.nn.Module) -> None:
        """Logger, checkpoints and resume, then the schedule, step runner and evaluator at the resumed step."""
        cfg, mesh = self.cfg, self.mesh
        meta, dropped = read_resume_point(Path(cfg.run.dir), resume, mesh.is_main)
        self.logger = None
        if mesh.is_main:
            m = cfg.metrics
            self.logger = MetricsLogger(Path(cfg.run.dir), cfg.train.steps, m.console, m.jsonl, m.tensorboard, stream)
        self.checkpoints = RunCheckpoints(
            cfg, mesh, self.args, self.model, self.optimizer, self.state, self.event, self.diloco
        )
        where = {"world_size": mesh.world_size, "resume_from": str(resume) if resume else None}
        if launch_env.restart_count():
            self.event("restart", attempt=launch_env.restart_count(), **where)
        self.event("world", attempt=launch_env.restart_count(), **where)  # each (re)start: elastic change points
        if resume:
            self.say(self.checkpoints.resume(resume, meta, dropped))
        self.scheduler = build_scheduler(self.optimizer, cfg, self.state.step)
        forward = forward_context(self.plan, mesh.device)
        common = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "loss": self.loss}
        common.update(plan=self.plan, mesh=mesh)
        if self.pipeline:
            self.runner: PlainStep | PipelineStep = PipelineStep(self.pipeline, **common)
        else:
            sync_all = self.plan.layout.sync_every_microbatch
            self.runner = PlainStep(train_model, forward, self.micro, self.accum, sync_all, **common)
        batches = (self.local_batch, self.micro)
        self.evaluate = Evaluator(self.data.val, cfg, mesh, self.model, self.loss, forward, self.pipeline, batches)
        self.watch = StepWatch(self)  # health checks, profiler, time breakdown

    def reposition_schedule(self) -> None:
        """The LR schedule at the current step (after a rollback loaded an older checkpoint)."""
        self.scheduler = self.runner.scheduler = build_scheduler(self.optimizer, self.cfg, self.state.step)

    def event(self, name: str, **fields: Any) -> None:
        if self.logger:
            self.logger.event(name, **fields)

    def say(self, text: str) -> None:
        if self.logger:
            self.logger.print(text)

    def step_once(self, measure: bool = True) -> StepResult:
        """Fetch this rank's slice of the next global batch and take one step. ``measure``:
        also take what a logged step reports (the same on every rank: it adds collectives)."""
        idx = self.state.sampler.next_batch(self.mesh.data_rank, self.mesh.layout.data_ranks)
        batch = self.data.train.get(idx).to(self.device, non_blocking=True)
        if self.diloco:
            warm = self.diloco.in_warmup(self.state.step + 1)
            self.runner.pre_update = self.diloco.average_grads if warm else None
        with self.comm.counting() if self.comm and measure else contextlib.nullcontext():
            result = self.runner.run(batch, measure)
            if self.diloco:  # the outer sync (counted on the "island" axis)
                self.diloco.after_step(self.state.step + 1)
        if measure:
            self.state_mem = result.state_mem or {}
            self.comm_bytes = self.comm.snapshot() if self.comm else {}
            if self.pipeline:
                self.pp_stats = gather_pipeline_stats(self.pipeline, self.mesh)
            tokens = self.local_batch * self.cfg.train.seq_len // self.mesh.layout.cp
            self.moe_stats = moe_record(self.model, self.loss, self.mesh, self.runner.reduce_loss, self.args, tokens)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.state.advance()
        if self.pipeline and measure and self.state.step == self.gantt_step:
            bubble = self.pp_stats["bubble_fraction"]
            write_gantt(self.pipeline, self.mesh, self.state.step, bubble, Path(self.cfg.run.dir), self.event)
        return result

    def fit(self) -> dict[str, Any]:
        """Train to train.steps (or a stop request); returns the summary."""
        try:
            with StopRequest(self.mesh, self.say) as stop:
                result = self._fit(stop)
            self.checkpoints.checkpointer.close()
            return result
        except BaseException:
            self.checkpoints.checkpointer.abandon()
            raise
        finally:
            if self.logger:
                self.logger.close()

    def _fit(self, stop: StopRequest) -> dict[str, Any]:
        t, st = self.cfg.train, self.state
        if st.step >= t.steps:  # resumed from a checkpoint at (or past) the end
            self.event("nothing_to_do", step=st.step, steps=t.steps)
            self.say(f"already trained to step {st.step} (train.steps = {t.steps}); raise train.steps to continue")
            return {"steps": st.step, "interrupted": False, "tokens": st.tokens_seen, "already_done": True}
        announce(self)
        interrupted, t_start = False, time.perf_counter()
        while st.step < t.steps:
            n = st.step + 1
            logged = is_logged(n, self.cfg.metrics.log_interval, t.steps)
            last = n == t.steps or stop.stop_after(n, logged)
            t0 = self.watch.before_step(n)
            result = self.step_once(measure=logged or last or n == self.gantt_step)
            if self.watch.after_step(n):  # went back to a checkpoint
                continue
            faults.maybe_kill("step", self.mesh.rank, st.step)  # tests: die right after this step
            faults.pace()  # tests: a run that lasts (nothing unless MESHFORGE_FAULT has pace:ms=M)
            dt = time.perf_counter() - t0
            self.metrics.add(dt, result)
            with self.phases("logging"):
                log_step(self, n, result, logged or last, dt)
            with self.phases("checkpoint"):
                self.checkpoints.checkpointer.poll()
                self.checkpoints.maybe_save(last, self.metrics.recent_step_time())
            if t.eval_interval and n % t.eval_interval == 0 and not last:
                self._evaluate_and_log()
            if last and n < t.steps:
                interrupted = True
                self.event("interrupted", step=n)
                break
        self.watch.close()
        with self.phases("checkpoint"):
            self.checkpoints.checkpointer.wait()
        val_loss = self._evaluate_and_log() if t.eval_batches else None
        return finish_run(self, interrupted, time.perf_counter() - t_start, val_loss)

    def _evaluate_and_log(self) -> float | None:
        with self.phases("eval"):
            v = self.evaluate()
        if self.logger and v is not None:
            self.logger.log_eval(self.state.step, v)
        return v


def train(cfg: Config, stream: TextIO | None = None) -> dict[str, Any]:
    """Run training on this rank: ``cfg`` is resolved here, once, for the process group's world."""
    plan = launch_plan(cfg, launch_env.world_size())
    was_deterministic = torch.are_deterministic_algorithms_enabled()  # process-wide: put back at the end
    clean = False
    mesh = build_mesh(plan.layout, plan.train.device, cpu_backend=plan.layout.offload == "cpu")
    cfg = plan
    try:
        plan, resume = agree_on_start(plan, mesh)
        cfg = plan
        try:
            result = Trainer(plan, mesh, stream, resume=Path(resume) if resume else None).fit()
            clean = True
            return result
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            instead = on_failure(cfg, mesh.rank, mesh.world_size, e)
            if instead is not None:
                raise instead from None
            raise
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        shutdown(clean)
        if launch_env.rank() == 0:
            run_lock.release(Path(cfg.run.dir))
