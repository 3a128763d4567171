"""The commands that go on from a run, printed as its last line (and when it fails).

A run with a resumable checkpoint (``checkpoint.final``, or ``checkpoint.interval``'s) continues
exactly in place: ``meshforge train --resume RUN_DIR --train.steps=M``. A run that kept only its
final weights can be fine-tuned from them in a new run directory, with a fresh optimizer whose
learning rate never rises above the one the run ended at (a re-warm to the peak undoes what the
decay gained).
"""

from __future__ import annotations

from pathlib import Path

from meshforge.checkpoint import store
from meshforge.config.run_plan import RunPlan
from meshforge.config.schedule import lr_at
from meshforge.config.sections import OptimConfig

_HOW = {
    "wsd": "exactly (wsd: from the end of its stable phase, as if it had been planned that long)",
    "constant": "exactly",
    "cosine": "(cosine: its decay is stretched to the new end; wsd would continue the curve)",
    "linear": "(linear: its decay is stretched to the new end; wsd would continue the curve)",
}


def resume_hint(plan: RunPlan, world: int, finished: bool, step: int | None = None) -> str:
    """The command that goes on from this run (``step``: the steps it took; default all): resume or
    extend it from its checkpoints, or (with none) fine-tune from its final weights."""
    run = Path(plan.run.dir)
    nproc = f" --nproc {world}" if world > 1 else ""
    if store.list_complete(run / "checkpoints"):
        if finished:
            more = f"--train.steps={2 * plan.train.steps}"
            return f"to continue it {_HOW[plan.optim.schedule]}: meshforge train --resume {run}{nproc} {more}"
        return f"to resume it from its newest checkpoint: meshforge train --resume {run}{nproc}"
    how = "no resumable checkpoint (checkpoint.final = false and checkpoint.interval = 0)"
    if (run / "final").is_dir():
        lr = ended_lr(plan.optim, plan.train.steps, plan.train.steps if step is None else step)
        return f"{how}; {finetune_command(run, world, lr)}"
    base = f"meshforge train --config {run / 'config.toml'}{nproc}"
    return f"{how}; to run it again with checkpoints: {base} --run.overwrite=true --checkpoint.final=true"


def ended_lr(optim: OptimConfig, steps: int, step: int) -> float:
    """The learning rate of the last of ``step`` steps taken in a run of ``steps``."""
    return lr_at(optim, steps, max(0, step - 1))


def finetune_command(run: Path, world: int, lr: float) -> str:
    """How to go on from ``run``'s final weights: a new run from them whose learning rate warms up
    to the ``lr`` the run ended at and stays there (no re-warm to the peak)."""
    nproc = f" --nproc {world}" if world > 1 else ""
    return (
        f"to fine-tune from its final weights (fresh optimizer, learning rate held at the {lr:.3g} it ended at): "
        f"meshforge train --config {run / 'config.toml'}{nproc} --model.init_from {run / 'final'} "
        f"--run.dir {run}-more --optim.schedule=constant --optim.lr={lr:.3g}"
    )
