"""Where a run starts, found and checked before anything is written into run.dir.

The pre-flight picks the checkpoint to resume from (``checkpoint.load``), verifies it
(files, hashes, metadata as data), and checks that this run can continue it: the same model
shape, the same data order (train.seed over the same corpus), and a meta.json whose train
state agrees with what the shards carry. Any refusal is raised there, so a refused resume
leaves the run it refused exactly as it was. Checkpoints passed over on the way (``latest``
falls back to an older one) are said once the run has started.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshforge.checkpoint import store
from meshforge.checkpoint.saver import checkpoint_to_load
from meshforge.checkpoint.store import CheckpointError
from meshforge.checkpoint.train_state import check_train_state
from meshforge.checkpoint.validate import checkpoint_shape
from meshforge.checkpoint.weights import shape_mismatch
from meshforge.config.run_plan import ResumePoint, RunPlan
from meshforge.config.schedule import decay_start, lr_at
from meshforge.launch.env import restart_count
from meshforge.models.shape import ModelShape

Meta = dict[str, Any]  # a checkpoint's meta.json


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

    root = Path(plan.run.dir) / "checkpoints"
    path, meta = latest_checkpoint(plan, root, note) if load == "latest" else checkpoint_to_load(load, root, note)
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


def latest_checkpoint(plan: RunPlan, root: Path, note: Callable[..., None]) -> tuple[Path | None, Meta | None]:
    """``checkpoint.load = latest`` for ``plan``: the newest complete checkpoint that verifies, except
    that a wsd run extended past its decay continues from the newest checkpoint whose steps its own
    schedule takes alike (the stable phase's end), not from the decay the shorter run ended with."""
    chosen = _continued_from(plan, root)
    if chosen is not None:
        try:
            return chosen, store.verify(chosen)
        except CheckpointError as e:
            note("checkpoint_skipped", level="warning", path=str(chosen), reason=str(e))
    return checkpoint_to_load("latest", root, note)


def _continued_from(plan: RunPlan, root: Path) -> Path | None:
    """Under wsd, the newest checkpoint ``plan``'s schedule continues, when that is not the newest one."""
    if plan.optim.schedule != "wsd":
        return None
    for i, c in enumerate(reversed(store.list_complete(root))):
        try:
            meta = store.read_meta(c.path)
        except CheckpointError:
            continue  # (latest's own fallback names it)
        if follows_schedule(meta, c.step, plan):
            return c.path if i else None
    return None


def _record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """meta.json's ``lr_schedule`` when it is whole (checkpoints written before it have none)."""
    rec = meta.get("lr_schedule")
    if not isinstance(rec, dict) or not isinstance(rec.get("schedule"), str):
        return None
    ints = all(type(rec.get(k)) is int for k in ("steps", "decay_start"))
    return rec if ints and isinstance(rec.get("next_lr"), (int, float)) else None


def follows_schedule(meta: dict[str, Any], step: int, plan: RunPlan) -> bool:
    """Whether the ``step`` steps of a checkpoint took the learning rates ``plan``'s wsd schedule
    gives them: the same schedule, or both still before their decay."""
    rec = _record(meta)
    if rec is None or rec["schedule"] != "wsd" or rec["steps"] == plan.train.steps:
        return True
    return step <= min(rec["decay_start"], decay_start(plan.optim, plan.train.steps))


def continuation_note(meta: dict[str, Any], plan: RunPlan) -> str | None:
    """How the schedule goes on from a checkpoint of a run of another length (None: as it was)."""
    rec, step, o, steps = _record(meta), meta.get("step"), plan.optim, plan.train.steps
    if rec is None or type(step) is not int or rec["steps"] == steps:
        return None
    if o.schedule == "wsd" and rec["schedule"] == "wsd" and step <= rec["decay_start"]:
        return (
            f"optim.schedule = wsd: the run goes on from the end of its stable phase (step {step}; the decay that "
            f"ended its {rec['steps']} steps is not continued) and now decays over steps "
            f"{decay_start(o, steps) + 1}-{steps}"
        )
    new, old = lr_at(o, steps, step), float(rec["next_lr"])
    if math.isclose(new, old, rel_tol=1e-6):
        return None
    why = f"the schedule is stretched to the new end (step {steps}; it ended at {rec['steps']})"
    if o.schedule == "wsd":
        why = f"no checkpoint from before its decay is left (step {rec['decay_start']}), so it goes on from there"
    hint = '; optim.schedule = "wsd" extends a run without this jump' if o.schedule in ("cosine", "linear") else ""
    return (
        f"optim.schedule = {o.schedule}: {why}: step {step + 1} takes learning rate {new:.3g}, where the "
        f"{rec['steps']}-step run would have taken {old:.3g}{hint}"
    )
