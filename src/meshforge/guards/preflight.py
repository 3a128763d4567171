"""The checks that can refuse a run, all made before anything is written and before any rank
starts: the config resolved into the run plan, the run directory, the data, the disk and the
memory fit. ``launch_plan`` is each rank's entry: rank 0 runs the checks, the others resolve
the same plan (and hold the fit against their own GPU).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from meshforge.checkpoint import store
from meshforge.checkpoint.resume_point import find_resume_point
from meshforge.checkpoint.weights import pretrained_shape, shape_mismatch
from meshforge.config import Config
from meshforge.config.run_plan import RunPlan
from meshforge.data.corpus import open_data
from meshforge.errors import ConfigError
from meshforge.guards.disk import check_disk, check_name_length
from meshforge.guards.foreign_files import foreign_entries, is_meshforge_run
from meshforge.guards.memory_fit import check_fit
from meshforge.health.flight_recorder import ENV as FLIGHT_RECORDER_ENV
from meshforge.health.text_check import refuse_binary
from meshforge.launch import env as launch_env
from meshforge.launch.env import restart_count
from meshforge.resolve import resolve

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def default_run_dir(cfg: Config) -> str:
    """runs/<preset>-<time>: a new directory per run unless run.dir names one."""
    return str(Path("runs") / f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")


def resuming(cfg: Config) -> bool:
    """Whether this start continues the run in run.dir (rather than starting a new one):
    an elastic restart always does; otherwise checkpoint.load = latest with a complete
    checkpoint there, unless run.overwrite asks for a fresh run."""
    if restart_count() > 0:
        return True
    if cfg.run.overwrite or cfg.checkpoint.load != "latest":
        return False
    return bool(store.list_complete(Path(cfg.run.dir) / "checkpoints"))


def check_run_dir(cfg: Config) -> Path:
    """Refuse a run.dir meshforge cannot or must not write: a file, a name too long, a folder of
    files meshforge did not write, or an old run (unless resuming it or run.overwrite is set)."""
    run_dir = Path(cfg.run.dir)
    check_name_length(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir = {run_dir} exists and is not a directory; choose another run.dir")
    foreign = [] if cfg.run.overwrite or is_meshforge_run(run_dir) else foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ConfigError(
            f"run.dir = {run_dir} holds files meshforge did not write ({shown}); meshforge writes a run only into a "
            "new or empty directory or one of its own runs: choose another run.dir, or pass --run.overwrite=true "
            "to write the run there anyway (your files are left alone, a config.toml is replaced)"
        )
    if (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite and not resuming(cfg):
        why = (
            "and no complete checkpoint to resume from (checkpoint.load = latest)"
            if cfg.checkpoint.load == "latest"
            else f"and checkpoint.load = {cfg.checkpoint.load!r} starts another run (only latest continues it)"
        )
        raise ConfigError(
            f"run.dir = {run_dir} already holds a run (metrics.jsonl) {why}; choose another run.dir or pass "
            "--run.overwrite=true to replace it"
        )
    load = cfg.checkpoint.load
    if cfg.run.overwrite and restart_count() == 0 and load not in ("latest", "none", ""):
        if _inside(Path(load), run_dir / "checkpoints"):
            raise ConfigError(
                f"checkpoint.load = {load} is inside run.dir = {run_dir}, whose checkpoints run.overwrite = true "
                "removes before the run starts; copy the checkpoint elsewhere first, or write the run elsewhere"
            )
    return run_dir


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def preflight(cfg: Config, world_size: int, launcher: bool = False) -> RunPlan:
    """Resolve the config into the run plan, check that it fits the device's memory, pick the run
    dir, make sure the data is usable, and find (and check) the checkpoint it resumes from: every
    refusal comes here, before anything is written. ``launcher``: run by `--nproc N`'s launcher,
    not a rank (it leaves reading every checkpoint shard to rank 0)."""
    plan = resolve(cfg, world_size)
    check_init_from(plan)
    if not plan.run.dir:
        plan = plan.with_run_dir(default_run_dir(plan))
    check_run_dir(plan)
    # A run that cannot fit its device hears that first, before any disk or data check. A
    # launcher on CUDA leaves the GPUs to the ranks (no CUDA context here): rank 0 then checks
    # the memory and after it the disk; the launcher still prepares the data once.
    ranks_check_fit = launcher and plan.world.device == "cuda"
    if not ranks_check_fit:
        check_fit(plan, launch_env.local_rank(), launch_env.local_world_size() or world_size)
    refuse_binary(plan.data.path, plan.data.allow_binary)
    if not ranks_check_fit:
        check_disk(plan)  # writable, and room for a checkpoint: refused here rather than mid-run
    data = open_data(plan, plan.shape)
    check_extras(plan)
    return plan.with_resume(find_resume_point(plan, resuming(plan), len(data.train), hashes=not launcher))


def check_init_from(plan: RunPlan) -> None:
    """model.init_from: a directory of weights of the [model] shape (read from its description,
    not its weights)."""
    path = plan.model.init_from
    if not path:
        return
    if not Path(path).is_dir():
        raise ConfigError(f"model.init_from = {path} is not a directory of weights")
    diff = shape_mismatch(pretrained_shape(path), plan.shape)
    if diff:
        raise ConfigError(f"model.init_from = {path} has another shape than [model]: " + "; ".join(diff))


def check_extras(plan: RunPlan) -> None:
    """Optional packages the plan asks for are installed (else refused before the run starts)."""
    if plan.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.wandb = true needs the wandb package; pip install wandb, or set metrics.wandb = false"
        )


def launch_plan(cfg: Config, world: int) -> RunPlan:
    """This rank's run plan (rank 0 also runs ``preflight``), with the environment that must be
    set before the process group starts."""
    for k, v in DETERMINISTIC_ENV.items():
        if cfg.train.deterministic:
            os.environ.setdefault(k, v)
    os.environ.setdefault(*FLIGHT_RECORDER_ENV)  # the hang watchdog reads it (before the process group starts)
    if world == 1 or launch_env.rank() == 0:
        return preflight(cfg, world)
    plan = resolve(cfg, world)
    if plan.world.device == "cuda":  # each rank holds the estimate against its own GPU (rank 0 did in preflight)
        check_fit(plan, launch_env.local_rank())
    return plan
