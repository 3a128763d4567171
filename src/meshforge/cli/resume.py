"""``meshforge train --resume RUN_DIR [--train.steps=M] [--section.key=value ...]``: continue a run
exactly, in its own run directory, from its resumable checkpoint (``checkpoint.final``'s at its
end, or ``checkpoint.interval``'s) to step M.

The run's config.toml (the plan it ran) is the config, with the overrides laid over it and
run.dir, run.overwrite and checkpoint.load pinned to continuing it; the pre-flight then picks the
checkpoint (checkpoint/resume_point.py: an extended wsd run goes on from its stable phase's end)
and checks it as it checks any resume. What cannot continue the run is refused here, one
paragraph and exit 2, before anything is written: a directory that is not a meshforge run, a run
with no resumable checkpoint (its final weights alone: the fine-tune command is named), a
train.steps not above the run's step, and an override that changes the model's shape or sends
the run elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshforge.checkpoint import store
from meshforge.checkpoint.continuing import ended_lr, finetune_command
from meshforge.checkpoint.resume_point import checkpoint_shape
from meshforge.checkpoint.weights import shape_mismatch
from meshforge.config import Config, load_config
from meshforge.errors import ConfigError
from meshforge.guards.foreign_files import is_meshforge_run
from meshforge.parallel.rule_types import product


def resume_config(args: Any, world: int) -> Config:
    """The config that continues the run ``args.resume`` names, on ``world`` ranks (``args``: the
    parsed ``train`` arguments); refuses what cannot continue it."""
    run = Path(args.resume)
    if args.config is not None:
        raise ConfigError(
            f"--resume {run} continues that run with its own config.toml; leave out --config {args.config} (to "
            "start a new run from it: --config RUN_DIR/config.toml --run.dir NEW_DIR)"
        )
    _check_run_dir(run)
    pins = {"run.dir": str(run), "run.overwrite": False, "checkpoint.load": "latest"}
    _check_pins(run, args.overrides, pins)
    config = load_config(run / "config.toml", {**args.overrides, **pins})
    complete = store.list_complete(run / "checkpoints")
    if not complete:
        raise ConfigError(_no_checkpoint(run, world))
    newest = complete[-1]
    _check_shape(run, newest.path, config, args.overrides)
    _check_world(run, config, args.overrides, world)
    steps = config.train.steps
    if steps <= newest.step:
        given = "train.steps" in args.overrides
        what = f"--train.steps={steps} is not above" if given else f"its train.steps = {steps} is not above"
        raise ConfigError(
            f"--resume {run}: {what} the step the run is at ({newest.step}, its checkpoint {newest.path.name}), so "
            f"there is nothing to train; give the step to continue it to, e.g. --train.steps={2 * newest.step}"
        )
    return config


def _check_run_dir(run: Path) -> None:
    """A directory holding a run meshforge wrote (its config.toml)."""
    fix = "give the run directory a run's last line names (runs/<preset>-<date>-<time>)"
    if not run.exists():
        raise ConfigError(f"--resume {run}: no such directory; {fix}")
    if not run.is_dir():
        raise ConfigError(f"--resume {run} is a file, not a run directory; {fix}")
    if not is_meshforge_run(run):
        raise ConfigError(
            f"--resume {run} is not a meshforge run directory (it holds no config.toml that meshforge wrote); {fix}, "
            "or start a new run with --config FILE.toml"
        )


def _check_pins(run: Path, overrides: dict[str, Any], pins: dict[str, Any]) -> None:
    """No override may send the continued run elsewhere, wipe it, or load another checkpoint."""
    for key, value in pins.items():
        given = overrides.get(key, value)
        same = Path(str(given)).resolve() == run.resolve() if key == "run.dir" else given == value
        if not same:
            raise ConfigError(
                f"--resume {run} continues the run in place from its own checkpoints, so --{key}={given} cannot go "
                f"with it; leave --{key} out (to branch a new run off a checkpoint: --config {run / 'config.toml'} "
                f"--checkpoint.load {run / 'checkpoints'} --run.dir NEW_DIR)"
            )


def _check_shape(run: Path, checkpoint: Path, config: Config, overrides: dict[str, Any]) -> None:
    """The overrides keep the model the run's checkpoint holds."""
    diff = shape_mismatch(checkpoint_shape(store.read_meta(checkpoint), checkpoint), config.shape)
    if diff:
        given = " ".join(f"--{k}" for k in overrides if k.startswith("model.")) or "the overrides"
        raise ConfigError(
            f"--resume {run} continues its model, but {given} change its shape ({'; '.join(diff)}); leave them "
            "out (a run continues the shape it has; another shape is a new run: --config FILE.toml)"
        )


def _check_world(run: Path, config: Config, overrides: dict[str, Any], world: int) -> None:
    """A run resumed on another number of ranks than its layout's, with no new layout given, most
    likely lacks the --nproc it ran with: say that, not only that the degrees do not multiply."""
    degrees = config.layout.degrees()
    ranks = product(degrees.values()) * config.layout.islands
    if any(k.startswith(("parallel.", "diloco.")) for k in overrides) or min(degrees.values()) < 1 or ranks == world:
        return
    shown = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "one rank"
    same = "leave out --nproc" if ranks == 1 else f"add --nproc {ranks} (under torchrun: {ranks} ranks in all)"
    raise ConfigError(
        f"--resume {run}: the run ran on {ranks} rank(s) ({shown}), this launch has {world}; {same} to continue it "
        f"as it ran, or give its layout on {world} rank(s) with --parallel.* keys (a checkpoint reshards onto "
        "another layout: docs/checkpointing.md)"
    )


def _no_checkpoint(run: Path, world: int) -> str:
    """Why a run without a resumable checkpoint cannot continue, and what it can do instead."""
    head = f"--resume {run}: the run kept no resumable checkpoint in {run / 'checkpoints'}"
    if (run / "final").is_dir():
        ran = load_config(run / "config.toml")
        lr = ended_lr(ran.optim, ran.train.steps, ran.train.steps)
        return (
            f"{head} (checkpoint.final = false and checkpoint.interval = 0), only its final weights, so it cannot "
            f"continue exactly; {finetune_command(run, world, lr)}"
        )
    return (
        f"{head} and no final weights (it stopped before its first save, or checkpoint.final and "
        f"checkpoint.save_final were false): nothing to continue; train it again: meshforge train --config "
        f"{run / 'config.toml'} --run.overwrite=true"
    )
