"""Where a run starts, found and checked before anything is written into run.dir.

The pre-flight picks the checkpoint to resume from (``checkpoint.load``), verifies it
(files, hashes, metadata as data), and checks that this run can continue it: the same model
shape, the same data order (train.seed over the same corpus), and a meta.json whose train
state agrees with what the shards carry. Any refusal is raised there, so a refused resume
leaves the run it refused exactly as it was. Checkpoints passed over on the way (``latest``
falls back to an older one) are said once the run has started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshforge.checkpoint.saver import checkpoint_to_load
from meshforge.checkpoint.store import CheckpointError
from meshforge.checkpoint.train_state import check_train_state
from meshforge.checkpoint.validate import checkpoint_shape
from meshforge.checkpoint.weights import shape_mismatch
from meshforge.config.run_plan import ResumePoint, RunPlan
from meshforge.launch.env import restart_count
from meshforge.models.shape import ModelShape


def find_resume_point(plan: RunPlan, resuming: bool, sequences: int) -> ResumePoint:
    """The checkpoint ``plan`` starts from on this elastic attempt (``resuming``: this start continues
    the run in run.dir), checked against the plan and the corpus's ``sequences``; raises
    CheckpointError when none can be used."""
    load, attempt = plan.checkpoint.load, restart_count()
    if not resuming and load in ("latest", "none", ""):
        return ResumePoint(None, attempt=attempt)
    skipped: list[tuple[str, str]] = []

    def note(event: str, **fields: Any) -> None:
        if event == "checkpoint_skipped":
            skipped.append((str(fields.get("path")), str(fields.get("reason"))))

    path, meta = checkpoint_to_load(load, Path(plan.run.dir) / "checkpoints", note)
    if path is None or meta is None:
        return ResumePoint(None, tuple(skipped), attempt)
    check_resumable(path, meta, plan, sequences)
    return ResumePoint(str(path), tuple(skipped), attempt)


def check_resumable(path: Path, meta: dict[str, Any], plan: RunPlan, sequences: int) -> None:
    """Refuse a checkpoint this run cannot continue: a meta.json that is not meshforge's, another
    model shape, another data order, or a train state the shards do not carry."""
    meta_path = path / "meta.json"
    said = _train_state(meta, meta_path)
    check_shape(meta, plan.shape, path)
    sampler = meta["sampler"]
    if sampler.get("seed") != plan.train.seed or sampler.get("num_sequences") != sequences:
        raise CheckpointError(
            f"checkpoint {path} continues a data order of train.seed = {sampler.get('seed')} over "
            f"{sampler.get('num_sequences')} sequences, but this run has train.seed = {plan.train.seed} over "
            f"{sequences} (train.seed, train.seq_len or the data changed); set them back to resume, or start a new "
            "run (checkpoint.load = none or another run.dir)"
        )
    from meshforge.checkpoint import sharded  # (here: it imports DCP, which a fresh run's launcher never needs)

    saved = sharded.read_train_state(path)
    if saved is not None:
        check_train_state(said, saved, meta_path)


def check_shape(meta: dict[str, Any], shape: ModelShape, path: Path) -> None:
    """Refuse a checkpoint written for another model shape than ``shape``."""
    diff = shape_mismatch(checkpoint_shape(meta, path), shape)
    if diff:
        raise CheckpointError(
            f"checkpoint {path / 'meta.json'} was written for another model shape ({'; '.join(diff)}); set [model] "
            "to the checkpoint's shape, or start a new run (checkpoint.load = none or another run.dir)"
        )


def _train_state(meta: dict[str, Any], meta_path: Path) -> dict[str, int]:
    """meta.json's step, tokens_seen and sampler position, checked to be whole numbers >= 0."""
    sampler = meta.get("sampler")
    said = {
        "step": meta.get("step"),
        "tokens_seen": meta.get("tokens_seen"),
        "consumed": sampler.get("consumed") if isinstance(sampler, dict) else None,
    }
    bad = [k for k, v in said.items() if type(v) is not int or v < 0]
    if bad or not isinstance(meta.get("world_size"), int) or not isinstance(meta.get("degrees"), dict):
        what = ", ".join(bad) or "world_size / degrees"
        raise CheckpointError(f"{meta_path}: {what} missing or not a whole number >= 0; the file is damaged or edited")
    return said
