"""Running a pipeline step on the ``pp`` mesh dimension, through ``torch.distributed.pipelining``.

The schedule runs all micro-batches of a step over this rank's stages (its chunks, cut by
``split.py``); its loss is the mean cross-entropy of a micro-batch and it divides the
accumulated gradients by their number, so the gradients equal the single-process mean over
the batch. The auxiliary losses (MoE balance, z-loss) of chunks before the last enter those
chunks' backward (``stage_aux.py``). Every action a rank executes (F, B, W) is timed, which
gives the measured bubble and the Gantt chart of a step.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.compat import pipeline_stage_fixups
from meshforge.config.layout import Layout
from meshforge.models.loss import LanguageModelLoss
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.pipeline.schedules import SCHEDULES, V_SHAPED, bubble_fraction, schedule_name
from meshforge.parallel.pipeline.split import chunk_ranks
from meshforge.parallel.pipeline.stage_aux import StageAux, forget_metadata_inference
from meshforge.parallel.tensor.apply import local_value

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # activations sent between stages in eval


def _pipelining() -> Any:
    """torch.distributed.pipelining, imported on first use: it pulls in torch._dynamo (~0.5 s
    of every rank's start), and most runs have no pipeline."""
    return importlib.import_module("torch.distributed.pipelining")


def schedule_class(name: str) -> type | None:
    """The installed PyTorch's class for a schedule, or None where it lacks it."""
    return getattr(_pipelining(), SCHEDULES[name][0], None)


@dataclass
class Action:
    kind: str  # F, B (input gradient, or all of backward), W (weight gradient)
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclass
class Timeline:
    """What one rank executed during one step, in seconds from the step's start."""

    rank: int
    span: float = 0.0
    actions: list[Action] = field(default_factory=list)

    def busy(self) -> float:
        return sum(a.end - a.start for a in self.actions)

    def max_in_flight(self) -> int:
        """The most micro-batches whose activations this rank held at once (forwards not
        yet matched by their backward), summed over its chunks."""
        events = sorted(
            [(a.end, 1) for a in self.actions if a.kind == "F"] + [(a.end, -1) for a in self.actions if a.kind == "B"]
        )
        cur = peak = 0
        for _, d in events:
            cur += d
            peak = max(peak, cur)
        return peak


class Pipeline:
    """This rank's pipeline: its chunks as stages, the schedule, and the step timeline."""

    def __init__(self, parts: list[nn.Module], chunks: list[int], mesh: Mesh, lay: Layout, loss: LanguageModelLoss):
        self.name = schedule_name(lay.pp_schedule)
        self.pp = lay.pp
        self.v = lay.pp_virtual_stages
        self.num_chunks = self.pp * self.v if self.name not in V_SHAPED else 2 * self.pp
        self.group = mesh.group("pp")
        self.pp_rank = mesh.coordinate("pp")
        self.chunks = chunks
        self.parts = parts
        self.loss = loss  # the run's one loss object (its context: loss_parallel under tp)
        self.has_first = 0 in chunks
        self.has_last = self.num_chunks - 1 in chunks
        self.last_part = parts[chunks.index(self.num_chunks - 1)] if self.has_last else None
        self.stage_aux = StageAux()  # the auxiliary losses of the chunks before the last
        for part, c in zip(parts, chunks, strict=True):
            if c != self.num_chunks - 1:
                self.stage_aux.attach(part)
        self.m = lay.num_microbatches  # resolved (meshforge/resolve.py) before any rank starts
        self.stages = [
            _pipelining().PipelineStage(part, c, self.num_chunks, mesh.device, group=self.group)
            for part, c in zip(parts, chunks, strict=True)
        ]
        cls = schedule_class(self.name)
        stage_arg: Any = self.stages if SCHEDULES[self.name][1] != "1" else self.stages[0]
        self.schedule = cls(stage_arg, n_microbatches=self.m, loss_fn=self._loss, scale_grads=True)
        self.record: Timeline | None = None
        # the forward arguments (positions, packed documents) of rows [start, stop) of the step's
        # batch, set by the step runner; every chunk reads its micro-batch's (``stage_args``)
        self.forward_args: Callable[[int, int], dict[str, Any]] | None = None
        self.microbatch = 0  # the micro-batch a chunk is running (set around each forward)
        self.rows = 0  # rows of this rank's batch in the current step
        self._t0 = 0.0
        for stage in self.stages:
            pipeline_stage_fixups(stage)
            self._instrument(stage)
            forget_metadata_inference(stage, loss, self.stage_aux)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, target, self.last_part)

    def _instrument(self, stage: Any) -> None:
        """Time every forward, backward and weight-gradient action the schedule runs."""
        chunk = stage.stage_index

        def timed(kind: str, fn: Any) -> Any:
            def run(mb: int, *a: Any, **kw: Any) -> Any:
                self.microbatch = mb  # (the forward's stage_args; a backward's recompute kept its own)
                t = time.perf_counter()
                try:
                    return fn(mb, *a, **kw)
                finally:
                    if self.record is not None:
                        k = "B" if kind == "B" else kind
                        self.record.actions.append(Action(k, chunk, mb, t - self._t0, time.perf_counter() - self._t0))

            return run

        stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = timed("W", stage.backward_weight_one_chunk)

    def _start(self, rank: int, measure: bool) -> None:
        """Measured steps only: a common start (a barrier), so the spans are comparable."""
        self.record = None
        if measure:
            dist.barrier(group=self.group)
            self.record = Timeline(rank)
        self._t0 = time.perf_counter()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, rank: int, measure: bool = True) -> torch.Tensor:
        """One forward/backward over all micro-batches of this rank's batch slice; returns
        this rank's part of the mean loss: the language-model loss (last chunk's rank) plus
        the auxiliary losses of its chunks' layers, which sum to the loss over the pp ranks.
        ``measure``: keep the step's timeline (bubble, in-flight, Gantt chart)."""
        self._start(rank, measure)
        self.rows = inputs.shape[0]
        losses: list[torch.Tensor] = []
        # torch <= 2.11 checks each micro-batch's strides against the first one's; a slice of
        # the (batch, seq + 1) token block has row stride seq + 1, its micro-batches seq
        inputs, targets = inputs.contiguous(), targets.contiguous()
        args = (inputs,) if self.has_first else ()
        kw: dict[str, Any] = {"target": targets, "losses": losses} if self.has_last else {}
        with self.loss.context():
            self.schedule.step(*args, **kw)
        if self.record is not None:
            self.record.span = time.perf_counter() - self._t0
        aux = self.stage_aux.take(self.m)  # earlier chunks' auxiliary losses: part of the loss, summed over pp
        self.loss.add_step_terms(aux)
        total = sum(aux.values(), torch.zeros((), device=inputs.device))
        if not losses:
            return total
        return torch.stack([local_value(loss.detach()).float() for loss in losses]).mean() + total

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss of a batch, forward only, one micro-batch at a time through the
        chunks in order (zero except on the last chunk's rank). Written out rather than
        ``schedule.eval``, which the V-shaped schedules do not support."""
        total = torch.zeros((), device=inputs.device, dtype=torch.float64)
        owner = chunk_ranks(self.pp, self.num_chunks // self.pp, self.name)
        part_of = dict(zip(self.chunks, self.parts, strict=True))
        peer = lambda c: dist.get_global_rank(self.group, owner[c])  # noqa: E731
        self.record, self.rows = None, inputs.shape[0]
        for mb, (mb_in, mb_tgt) in enumerate(
            zip(inputs.tensor_split(self.m), targets.tensor_split(self.m), strict=True)
        ):
            self.microbatch, h = mb, None
            for c in range(self.num_chunks):
                if owner[c] != self.pp_rank:
                    continue
                if c == 0:
                    h = mb_in
                elif owner[c - 1] != self.pp_rank:
                    head = torch.zeros(4, dtype=torch.int64, device=inputs.device)  # shape, dtype
                    dist.recv(head, src=peer(c - 1), group=self.group)
                    *shape, code = head.tolist()
                    h = torch.empty(*shape, device=inputs.device, dtype=_DTYPES[code])
                    dist.recv(h, src=peer(c - 1), group=self.group)
                h = part_of[c](h)
                if c == self.num_chunks - 1:
                    with self.loss.context():
                        loss = self.loss.token_sum(h, mb_tgt, part_of[c])
                    total += local_value(loss).double()
                elif owner[c + 1] != self.pp_rank:
                    h = h.contiguous()
                    head = torch.tensor([*h.shape, _DTYPES.index(h.dtype)], dtype=torch.int64, device=inputs.device)
                    dist.send(head, dst=peer(c + 1), group=self.group)
                    dist.send(h, dst=peer(c + 1), group=self.group)
        return total

    def stage_args(self) -> dict[str, Any] | None:
        """The current micro-batch's forward arguments (positions, documents); None when the step
        runner set none (its rows are an equal share of the batch, as the schedule splits it)."""
        if self.forward_args is None or self.rows == 0:
            return None
        per = self.rows // self.m
        return self.forward_args(self.microbatch * per, (self.microbatch + 1) * per)

    def timeline(self) -> Timeline | None:
        return self.record

    def bubble(self) -> float:
        """This rank's idle fraction of the last step."""
        r = self.record
        return 0.0 if r is None or r.span <= 0 else max(0.0, 1.0 - r.busy() / r.span)

    def theory(self) -> float:
        return bubble_fraction(self.name, self.pp, self.m, self.v)
