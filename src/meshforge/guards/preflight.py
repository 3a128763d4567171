"""The checks that can refuse a run, all made before anything is written and before any rank
starts: the config resolved into the run plan (resolve.py), the weights it starts from, the run
directory (not busy, ours to write), the memory fit, the data, the disk and the checkpoint it
resumes from.

``preflight`` runs once per launch, in the process that starts the run (cli/train.py: this
process, ``--nproc N``'s launcher, or under plain torchrun rank 0); the plan it returns is the
verdict the ranks train on. What it cannot check there is each rank's own: a GPU's memory
(``check_own_gpu``: the launcher holds no CUDA context) and, under plain torchrun, the plan of a
rank other than 0 (``follower_plan``: the same resolution; rank 0 tells it run.dir and the
checkpoint once the process group is up).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from meshforge.checkpoint import store
from meshforge.checkpoint.resume_point import find_resume_point
from meshforge.checkpoint.weights import check_pretrained_files, pretrained_shape, shape_mismatch
from meshforge.config import Config
from meshforge.config.run_plan import RunPlan
from meshforge.data.corpus import open_data
from meshforge.errors import ConfigError
from meshforge.guards.disk import check_disk, check_name_length
from meshforge.guards.foreign_files import foreign_entries, is_meshforge_run, refuse_links_in_run
from meshforge.guards.memory_fit import check_fit
from meshforge.guards.run_lock import refuse_if_held
from meshforge.health.text_check import refuse_binary
from meshforge.launch import env as launch_env
from meshforge.launch.env import restart_count
from meshforge.parallel.fault_tolerance.lighthouse import check_reachable
from meshforge.resolve import resolve


def default_run_dir(plan: RunPlan) -> str:
    """runs/<preset>-<time>: a new directory per run unless run.dir names one."""
    return str(Path("runs") / f"{plan.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")


def resuming(plan: RunPlan) -> bool:
    """Whether this start continues the run in run.dir (rather than starting a new one):
    an elastic restart always does; otherwise checkpoint.load = latest with a complete
    checkpoint there, unless run.overwrite asks for a fresh run."""
    if restart_count() > 0:
        return True
    if plan.run.overwrite or plan.checkpoint.load != "latest":
        return False
    return bool(store.list_complete(Path(plan.run.dir) / "checkpoints"))


def check_run_dir(plan: RunPlan) -> Path:
    """Refuse a run.dir meshforge cannot or must not write: a file, a name too long, one another
    live run holds, a folder of files meshforge did not write, or an old run (unless resuming it
    or run.overwrite is set)."""
    run_dir = Path(plan.run.dir)
    check_name_length(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir = {run_dir} exists and is not a directory; choose another run.dir")
    refuse_if_held(run_dir)  # a look only: the launch takes the lock itself once this verdict is in
    refuse_links_in_run(run_dir)  # nothing is ever written through a link (or into a FIFO) found there
    foreign = [] if plan.run.overwrite or is_meshforge_run(run_dir) else foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ConfigError(
            f"run.dir = {run_dir} holds files meshforge did not write ({shown}); meshforge writes a run only into a "
            "new or empty directory or one of its own runs: choose another run.dir, or pass --run.overwrite=true "
            "to write the run there anyway (your files are left alone, a config.toml is replaced)"
        )
    rejoining = plan.fault_tolerance.enabled  # a replica group started again continues in place (it heals)
    if (run_dir / "metrics.jsonl").exists() and not plan.run.overwrite and not resuming(plan) and not rejoining:
        why = (
            "and no complete checkpoint to resume from (checkpoint.load = latest)"
            if plan.checkpoint.load == "latest"
            else f"and checkpoint.load = {plan.checkpoint.load!r} starts another run (only latest continues it)"
        )
        raise ConfigError(
            f"run.dir = {run_dir} already holds a run (metrics.jsonl) {why}; choose another run.dir or pass "
            "--run.overwrite=true to replace it"
        )
    load = plan.checkpoint.load
    if plan.run.overwrite and restart_count() == 0 and load not in ("latest", "none", ""):
        if _inside(Path(load), run_dir / "checkpoints"):
            raise ConfigError(
                f"checkpoint.load = {load} is inside run.dir = {run_dir}, whose checkpoints run.overwrite = true "
                "removes before the run starts; copy the checkpoint elsewhere first, or write the run elsewhere"
            )
    return run_dir


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def preflight(config: Config, world_size: int, *, ranks_per_node: int | None = None, launcher: bool = False) -> RunPlan:
    """Resolve the config into the run plan for ``world_size`` ranks (``ranks_per_node`` of them
    per node; default: the launcher's environment says), pick the run dir, and make every check
    that can refuse the run, before anything is written; returns the plan the run trains on, with
    the checkpoint it resumes from. ``launcher``: run by ``--nproc N``'s launcher, which leaves
    each GPU's memory to its rank (it opens no CUDA context)."""
    plan = resolve(config, world_size, ranks_per_node=ranks_per_node)
    if plan.fault_tolerance.enabled:
        check_reachable(plan.fault_tolerance.lighthouse)
    check_init_from(plan)
    if not plan.run.dir:
        plan = plan.with_run_dir(default_run_dir(plan))
    check_utf8(plan)
    check_run_dir(plan)
    # A run that cannot fit its device hears that first, before any disk or data check.
    if not (launcher and plan.world.device == "cuda"):
        check_fit(plan, launch_env.local_rank(), launch_env.local_world_size() or world_size)
    refuse_binary(plan.data.path, plan.data.allow_binary)
    check_disk(plan)  # writable, and room for a checkpoint: refused here rather than mid-run
    data = open_data(plan, plan.shape)
    check_extras(plan)
    return plan.with_resume(find_resume_point(plan, resuming(plan), len(data.train)))


def check_utf8(plan: RunPlan) -> None:
    """config.toml is UTF-8 text: a setting holding bytes that are not (a run.dir or data.path named
    in another encoding) is refused before anything is written, not half-way through writing it."""
    section = ""
    for line in plan.to_toml().splitlines():
        if line.startswith("["):
            section = line.strip("[]") + "."
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            key, _, value = line.partition(" = ")
            raise ConfigError(
                f"{section}{key} = {ascii(value)} holds bytes that are not UTF-8, which config.toml (UTF-8 text) "
                "cannot record; rename the directory or file to a UTF-8 name, or choose another"
            ) from None


def check_init_from(plan: RunPlan) -> None:
    """model.init_from: a directory of weights of the [model] shape (read from its description,
    not its weights)."""
    path = plan.model.init_from
    if not path:
        return
    if not Path(path).is_dir():
        what = "does not exist" if not Path(path).exists() else "is not a directory of weights"
        raise ConfigError(
            f"model.init_from = {path} {what}; give a run's final/ or the output of "
            "`meshforge convert --from-hf DIR --out WEIGHTS` (a checkpoint resumes with checkpoint.load instead)"
        )
    diff = shape_mismatch(pretrained_shape(path), plan.shape)
    if diff:
        raise ConfigError(f"model.init_from = {path} has another shape than [model]: " + "; ".join(diff))
    check_pretrained_files(path, plan.shape)


def check_extras(plan: RunPlan) -> None:
    """Optional packages the plan asks for are installed (else refused before the run starts)."""
    if plan.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.wandb = true needs the wandb package; pip install wandb, or set metrics.wandb = false"
        )


def check_own_gpu(plan: RunPlan) -> None:
    """On CUDA, each rank holds the fit estimate against its own GPU (the launcher's pre-flight
    could not: it opens no CUDA context)."""
    if plan.world.device == "cuda":
        check_fit(plan, launch_env.local_rank())


def follower_plan(config: Config, world_size: int) -> RunPlan:
    """A plain-torchrun rank other than 0: the plan resolved as rank 0's pre-flight resolves it,
    and its own GPU's fit; rank 0 alone checks the rest and tells it run.dir and the checkpoint
    once the process group is up (train/loop.py)."""
    plan = resolve(config, world_size)
    check_own_gpu(plan)
    return plan
