"""What a run executes: ``RunPlan``, the user's config resolved once against the world it
runs in (``World``: device, world size, torch and the installed extras).

Every automatic value is replaced by what runs, and every decision the layout implies (FSDP2
or DDP, autocast or cast-once, fp8 all-gather, bf16 ZeRO-1) is taken once, in resolve.py, and
stored here; the trainer, ``parallelize``, the planner's ``--config``, the fit check and the
report read the plan and derive nothing again. ``to_toml`` is the run directory's config.toml:
the concrete config, with the decisions and every forced change (and why) as comments, so
rerunning it reproduces the run. ``to_json`` / ``from_json`` carry the whole plan from
``meshforge train --nproc N``'s launcher to its ranks, which then neither resolve nor check again.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from meshforge.config import Config, to_dict, to_toml
from meshforge.config.layout import BatchSplit, Layout
from meshforge.config.load import config_from_sections
from meshforge.config.sections import (
    CheckpointConfig,
    DataConfig,
    DiLoCoConfig,
    FaultToleranceConfig,
    HealthConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
)
from meshforge.config.values import coerce
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape

DECIDED = ("fsdp", "autocast", "fp8_all_gather", "flat_zero1", "ddp", "async_tp")  # RunPlan's decisions
MAX_PLAN_BYTES = 1 << 20  # a plan is a few KiB


@dataclass(frozen=True)
class World:
    """What a run is resolved against besides the config."""

    size: int
    device: str  # "cpu" | "cuda"
    ranks_per_node: int | None = None
    torch: str = ""
    fp8_native: bool = False  # the device has fp8 matmuls (CUDA compute capability >= 8.9); else emulated
    split_backward_custom_functions: bool = True  # compat: a zero-bubble weight pass crosses autograd.Functions
    symm_mem: bool = False  # torch's symmetric-memory fused matmul collectives run here (CUDA)
    tokenizer_vocab: int | None = None  # data.tokenizer's vocabulary when it is a tokenizer.json; None: bytes


@dataclass(frozen=True)
class Change:
    """A value the resolution set differently from what the config asked, and why."""

    key: str
    given: object
    used: object
    reason: str

    def line(self) -> str:
        return f"{self.key} = {self.given!r} runs as {self.used!r}: {self.reason}"


@dataclass(frozen=True)
class ResumePoint:
    """Where the run starts, found and checked by rank 0's pre-flight before anything is written
    (a checkpoint it cannot load refuses the run there, leaving run.dir as it was)."""

    path: str | None  # the checkpoint to resume from; None: a fresh start
    skipped: tuple[tuple[str, str], ...] = ()  # (checkpoint, why) passed over for an older one: said at the start
    attempt: int = 0  # the elastic attempt it was found for: a later attempt looks again (its run saved since)


@dataclass(frozen=True)
class RunPlan:
    """A resolved run: a concrete config (no ``auto`` left), the world, and the decisions."""

    config: Config
    world: World
    fsdp: bool  # data parallelism (and a world of one's cast-once or offload) on FSDP2
    autocast: bool  # bf16 from torch.autocast (else from FSDP2's policy, or fp32)
    fp8_all_gather: bool  # FSDP2 gathers fp8 weights (scales precomputed before each forward)
    flat_zero1: bool  # bf16/fp8 ZeRO-1 on FlatZero1 (it reduces in its own step)
    ddp: bool  # the model is wrapped in DDP
    changes: tuple[Change, ...] = ()
    resume: ResumePoint | None = None  # set by rank 0's pre-flight (None: not looked for on this rank)
    async_tp: str = "off"  # how tp collectives overlap the GEMMs: off | ring | symm_mem | micro_pipeline

    # the config's parts, read the same way everywhere: plan.layout.tp, plan.shape.hidden, plan.train.seq_len
    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def shape(self) -> ModelShape:
        return self.config.shape

    @property
    def layout(self) -> Layout:
        return self.config.layout

    @property
    def train(self) -> TrainConfig:
        return self.config.train

    @property
    def optim(self) -> OptimConfig:
        return self.config.optim

    @property
    def data(self) -> DataConfig:
        return self.config.data

    @property
    def checkpoint(self) -> CheckpointConfig:
        return self.config.checkpoint

    @property
    def metrics(self) -> MetricsConfig:
        return self.config.metrics

    @property
    def run(self) -> RunConfig:
        return self.config.run

    @property
    def health(self) -> HealthConfig:
        return self.config.health

    @property
    def profile(self) -> ProfileConfig:
        return self.config.profile

    @property
    def diloco(self) -> DiLoCoConfig:
        return self.config.diloco

    @property
    def fault_tolerance(self) -> FaultToleranceConfig:
        return self.config.fault_tolerance

    @property
    def batch(self) -> BatchSplit:
        """This run's split of a global batch over a data-parallel rank (the layout's: ``Layout.batch_split``)."""
        return self.layout.batch_split(self.train.global_batch_size)

    def with_run_dir(self, run_dir: str) -> RunPlan:
        """The same plan writing into ``run_dir`` (picked by rank 0, after resolution)."""
        run = dataclasses.replace(self.config.run, dir=run_dir)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, run=run))

    def with_resume(self, point: ResumePoint) -> RunPlan:
        """The same plan starting from ``point`` (found by the pre-flight, on rank 0)."""
        return dataclasses.replace(self, resume=point)

    def decisions(self) -> dict[str, object]:
        return {
            "device": self.world.device,
            "world_size": self.world.size,
            "fsdp": self.fsdp,
            "ddp": self.ddp,
            "autocast": self.autocast,
            "fp8_all_gather": self.fp8_all_gather,
            "flat_zero1": self.flat_zero1,
            "async_tp": self.async_tp,
        }

    def to_json(self) -> str:
        """The whole plan as the launcher hands it to its ranks (``from_json`` reads it back)."""
        values = {sec: {k: v for k, v in body.items() if v is not None} for sec, body in to_dict(self.config).items()}
        resume = dataclasses.asdict(self.resume) if self.resume else None
        changes = [[c.key, c.given, c.used, c.reason] for c in self.changes]
        decided = {k: getattr(self, k) for k in DECIDED}
        return json.dumps(
            {"config": values, "world": dataclasses.asdict(self.world), "decided": decided}
            | {
                "changes": changes,
                "resume": resume,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RunPlan:
        """A plan ``to_json`` wrote, every value checked against its type (the config's also by
        value) before it is trusted; ConfigError names what is wrong."""
        where = "the launcher's run plan"
        try:
            if len(text) > MAX_PLAN_BYTES:
                raise ValueError(f"{len(text):,} characters")
            doc = json.loads(text)
            config = config_from_sections(doc["config"], where)
            world = World(**_typed(World, doc["world"], "world"))
            decided = _typed(cls, doc["decided"], "plan", DECIDED)
            changes = tuple(Change(str(k), g, u, str(r)) for k, g, u, r in doc["changes"])
            resume = _resume(doc["resume"])
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise ConfigError(f"{where} is not readable ({type(e).__name__}: {e})") from None
        return cls(config=config, world=world, changes=changes, resume=resume, **decided)

    def to_toml(self) -> str:
        """config.toml: the concrete config, headed by the decisions and the changes as comments."""
        said = ", ".join(f"{k} = {v}" for k, v in self.decisions().items())
        head = [f"resolved by meshforge (torch {self.world.torch}): {said}"]
        head += [f"changed: {c.line()}" for c in self.changes]
        return to_toml(self.config, {"model": head})


def _typed(cls: type, values: dict[str, Any], what: str, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``values`` for the fields ``names`` (default: every field) of dataclass ``cls``, each checked
    against its annotation; any other or missing name is refused."""
    hints = typing.get_type_hints(cls)
    names = names or tuple(f.name for f in dataclasses.fields(cls))
    if not isinstance(values, dict) or set(values) != set(names):
        raise ValueError(f"{what}: expected the fields {', '.join(names)}")
    return {k: coerce(f"{what}.{k}", values[k], hints[k]) for k in names}


def _resume(value: Any) -> ResumePoint | None:
    if value is None:
        return None
    point = _typed(ResumePoint, value, "resume")
    skipped = point["skipped"]
    if not all(isinstance(s, (list, tuple)) and len(s) == 2 for s in skipped):
        raise ValueError("resume.skipped: expected (checkpoint, reason) pairs")
    return ResumePoint(point["path"], tuple((str(a), str(b)) for a, b in skipped), point["attempt"])
