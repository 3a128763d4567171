"""``meshforge train``: its arguments (``--section.key=value`` overrides beside --config or
--resume, --nproc, --max-restarts, --dry-run) and the launch, in the order it happens:

1. the config is read once, by the checked loader (config/load.py: no device, FIFO or
   oversized file is ever opened for reading), before anything else looks at it (--resume:
   the run's config.toml, cli/resume.py);
2. the pre-flight (guards/preflight.py) runs once per launch, in the process that starts the
   run: this one, ``--nproc N``'s launcher, or under plain torchrun rank 0; its run plan is
   the verdict every rank trains on (``--nproc``'s ranks get it from the launcher: they
   neither resolve nor check again);
3. that process alone holds run.dir's lock, from before it writes anything (it prepares the
   run directory: train/run_dir.py) until the launch is over;
4. this process trains (train/loop.py), or N local ranks do, each rank 0 writing the run
   report whatever the outcome.

Imported only when the command is ``train`` (cli/main.py keeps ``meshforge --help`` free of torch).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from meshforge.config import Config
from meshforge.config.run_plan import RunPlan
from meshforge.errors import ConfigError, MeshforgeError, suggest
from meshforge.launch import env as launch_env
from meshforge.launch.tie import handed_plan, tie_to_launcher

TRAIN_USAGE = """usage: meshforge train [--config FILE | --resume RUN_DIR] [--nproc N] [--max-restarts K]
                       [--dry-run] [--section.key=value ...]

Train a model. Any config key can be overridden as --section.key=value or --section.key value,
e.g. --train.steps=100 --model.preset llama3.2-1b --optim.lr 3e-4. See README.md, configs/ for
examples and docs/configuration.md for what each key means.

  --config FILE      a TOML config (a run's config.toml reproduces that run)
  --resume RUN_DIR   continue that run exactly, in place, from its checkpoint to --train.steps=M (its last line
                     names the command); an optim.schedule = "wsd" run extended is the run planned that long
  --nproc N          local ranks to start (default 1; under torchrun leave it out)
  --max-restarts K   restart the ranks up to K times after a failure, resuming from the last checkpoint
  --dry-run          resolve the config for --nproc ranks, print it and the planner's estimate, and exit:
                     0 when it fits, 2 when it does not (or this machine refuses it)

config keys (type, default):"""

_TRAIN_FLAGS = ("--config", "--resume", "--nproc", "--max-restarts", "--dry-run", "--help")
_COUNTS = {  # flag -> (lowest, highest, what it counts)
    "nproc": (1, 4096, "the local ranks to start; under torchrun leave it out"),
    "max-restarts": (0, 10_000, "restarts after a failure; 0: none"),
}


class TrainArgs(NamedTuple):
    """``meshforge train``'s arguments but --dry-run (``cmd_train`` reads that itself)."""

    config: str | None  # --config
    nproc: int
    restarts: int  # --max-restarts
    overrides: dict[str, Any]  # {section.key: value}
    resume: str | None = None  # --resume RUN_DIR


def parse_train_args(argv: list[str]) -> TrainArgs:
    """Split ``train`` arguments into the config file, nproc, max restarts and the overrides."""
    from meshforge.config import key_type, parse_value

    config, resume, nproc, restarts = None, None, 1, 0
    overrides: dict[str, Any] = {}
    argv = [a for a in argv if a != "--dry-run"]
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            elif "." in name:
                if key_type(name) not in (None, bool):
                    raise ConfigError(f"--{name} needs a value, e.g. --{name}=VALUE (only boolean keys stand alone)")
                value = "true"  # a bare --section.flag turns a boolean on
            elif name not in ("help",):
                raise ConfigError(f"--{name} needs a value")
        i += 1
        if name == "config":
            config = value
        elif name == "resume":
            resume = value
        elif name in ("nproc", "max-restarts"):
            n = _count(name, value)
            nproc, restarts = (n, restarts) if name == "nproc" else (nproc, n)
        elif "." in name:
            parsed = parse_value(value)
            # a text key takes the text as written: --run.dir=1, --run.dir nan, --data.path true
            overrides[name] = value if key_type(name) is str and not isinstance(parsed, str) else parsed
        else:
            raise ConfigError(
                f"unknown option --{name}; {suggest('--' + name, _TRAIN_FLAGS, cutoff=0.6)} "
                "(or a --section.key=value config override)"
            )
    return TrainArgs(config, nproc, restarts, overrides, resume)


def _count(name: str, value: str) -> int:
    lo, hi, what = _COUNTS[name]
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--{name} takes a whole number, got '{value}'") from None
    if not lo <= n <= hi:
        raise ConfigError(f"--{name} {n} must be between {lo} and {hi} ({what})")
    return n


def cmd_train(argv: list[str]) -> int:
    tie_to_launcher()  # a rank that `meshforge train --nproc N` started dies with it (nothing under torchrun)
    if "--help" in argv or "-h" in argv:
        from meshforge.cli.help_text import fit, terminal_width
        from meshforge.config.reference import describe_keys

        print(fit(TRAIN_USAGE, terminal_width()))
        print(describe_keys(terminal_width()))
        return 0
    handed = handed_plan()
    if handed is not None:  # a rank of `meshforge train --nproc N`: its launcher's verdict (argv: only its name)
        return _rank_of_launcher(RunPlan.from_json(handed))
    from meshforge.config import load_config

    args = parse_train_args(argv)
    if args.resume is not None:
        from meshforge.cli.resume import resume_config

        config = resume_config(args, launch_env.world_size() if args.nproc == 1 else args.nproc)
    else:
        config = load_config(args.config, args.overrides)  # the one read of --config
    if "--dry-run" in argv:
        return dry_run(config, args.nproc if "--nproc" in " ".join(argv) else launch_env.world_size())
    c = config.checkpoint
    if args.restarts and ((c.interval == 0 and c.memory_interval == 0) or c.load == "none"):
        raise ConfigError(
            f"--max-restarts {args.restarts}: a restarted group resumes from the last complete checkpoint, so it "
            'needs checkpoint.interval > 0 (or "auto") or checkpoint.memory_interval > 0, and checkpoint.load = '
            "latest; e.g. --checkpoint.interval=100"
        )
    if not launch_env.under_launcher():
        from meshforge.launch.local import check_nproc

        check_nproc(args.nproc, config.train.device)
        return _launch(config, args.nproc, args.restarts)
    if args.nproc > 1:
        raise ConfigError("--nproc starts ranks itself; under torchrun leave it out (torchrun sets the ranks)")
    if launch_env.rank() == 0:  # plain torchrun: rank 0 launches (checks, holds run.dir), the others follow
        return _launch(config, launch_env.world_size(), 0)
    from meshforge.guards.preflight import follower_plan

    return _train_here(follower_plan(config, launch_env.world_size()))


def _launch(config: Config, nproc: int, restarts: int) -> int:
    """The launch's one pre-flight and its one hold on run.dir, then the training: in this process
    (a world of one, or a torchrun rank 0) or on ``nproc`` local ranks, handed the plan."""
    from meshforge.guards.preflight import preflight

    here = launch_env.under_launcher() or (nproc == 1 and not restarts)
    plan = preflight(config, nproc, ranks_per_node=None if here else nproc, launcher=not here)
    with holding_run_dir(plan) as refused:
        if here:
            return _train_here(plan)
        from meshforge.launch.local import launch_local

        # the ranks train on the plan; their arguments only name the run (for ps and pgrep)
        code = launch_local(nproc, ["train", f"--run.dir={plan.run.dir}"], restarts, plan=plan.to_json())
        if code == 2:
            refused()
        return code


@contextlib.contextmanager
def holding_run_dir(plan: RunPlan) -> Iterator[Callable[[], None]]:
    """run.dir locked (the launch's one lock, held across elastic restarts: its ranks never lock)
    and prepared for the run, before anything is written into it; let go when the launch ends.
    Yields ``refused()``: a fault-tolerant group refused by the live groups (exit 2) before its first
    step leaves no run.dir behind where this launch made it (the refusal is only known once it joins)."""
    from meshforge.guards import run_lock
    from meshforge.train.run_dir import forget_unstarted, prepare_run_dir

    run_dir = Path(plan.run.dir)
    new = not run_dir.exists()
    fresh = plan.fault_tolerance.enabled and new and launch_env.restart_count() == 0
    said: list[bool] = []
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_lock.hold(run_dir, quiet=launch_env.restart_count() > 0)  # a torchrun restart takes it over
    try:
        prepare_run_dir(plan)
        yield lambda: said.append(True)
    except MeshforgeError:
        said.append(True)
        raise
    finally:
        unstarted = new and forget_unstarted(run_dir)  # stopped or refused before a rank wrote a line
        if lock is not None:
            lock.release()
        metrics = run_dir / "metrics.jsonl"
        if fresh and said and not (metrics.exists() and metrics.stat().st_size):
            shutil.rmtree(run_dir, ignore_errors=True)  # every file in it is this launch's
        elif unstarted:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # (now empty, unless something came meanwhile: then it stays)


def _rank_of_launcher(plan: RunPlan) -> int:
    """A rank of ``--nproc N``: the launcher checked everything but each GPU's own memory."""
    from meshforge.guards.preflight import check_own_gpu

    check_own_gpu(plan)
    return _train_here(plan)


def _train_here(plan: RunPlan) -> int:
    """Train on this rank, then (rank 0) write run.dir/report.html from whatever the run wrote,
    also after a failed or stopped run. Written here, above train/, so that training never
    imports the analysis side (report/ reads the planner)."""
    from meshforge.train.loop import train

    try:
        return 0 if train(plan) else 1
    finally:
        if launch_env.rank() == 0:  # under torchrun, rank 0's dir is the run's
            write_run_report(plan)


def write_run_report(plan: RunPlan) -> None:
    """run.dir/report.html (unless metrics.report = false); a report error is logged as an
    event (``report_failed``), never raised over the run's own outcome."""
    from meshforge.guards.disk import describe
    from meshforge.report import write_report
    from meshforge.train.run_dir import event_writer

    run_dir = Path(plan.run.dir)
    if not plan.metrics.report or not ((run_dir / "metrics.jsonl").is_file() or (run_dir / "events.jsonl").is_file()):
        return
    try:
        write_report([run_dir], run_dir / "report.html")
    except Exception as e:  # noqa: BLE001 - the report must never hide the training outcome
        why = describe(run_dir / "report.html", e, "write") if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        print(f"meshforge: note: report.html skipped ({why})", file=sys.stderr)
        try:
            event_writer(plan.run.dir)("report_failed", error=why[:2000])
        except OSError:
            pass


def dry_run(config: Config, world: int) -> int:
    """Print the run plan for ``world`` ranks on this machine (the config.toml a run would write),
    the device and its memory, and the planner's estimate of exactly that layout on it (the one
    the pre-flight fit check uses); start nothing and write nothing (run.dir is not touched).
    Returns the verdict as the exit code: 0 when the run fits, 2 when it does not (or this
    machine refuses it), so that a script can act on it."""
    from meshforge.guards.memory_fit import device_memory, estimate_run
    from meshforge.resolve import resolve

    plan = resolve(config, world, machine=False)
    print(f"# meshforge train --dry-run: the run plan for {world} rank(s)\n{plan.to_toml()}")
    refused = False  # the verdict is the exit code: 2 when the run would be refused or does not fit
    try:  # what only the machine decides (CPU offload needs a GPU, fp8 needs torchao)
        resolve(config, world)
    except MeshforgeError as e:
        print(f"on this machine meshforge train refuses it: {e}")
        refused = True
    cuda = plan.world.device == "cuda"
    mem = device_memory(cuda, 0, 1 if cuda else world)
    print(f"device: {mem.describe()}" + (" (GPU 0; each rank checks its own)" if cuda and world > 1 else ""))
    run = estimate_run(plan, mem)
    e = run.estimate
    if e is None:
        print(f"planner: no estimate for this layout ({run.error})")
        return 2 if refused else 0
    fits = "fits" if e.fits else f"does NOT fit: {e.overflow}"
    if run.islands > 1:
        print(f"diloco: {run.islands} islands of {run.ranks} rank(s); the estimate is one island's")
    skip = " (train.skip_memory_check = true: not checked)" if plan.train.skip_memory_check else ""
    print(
        f"planner estimate on {run.ranks} x {run.hardware}: memory {e.memory['total']:.2f} GiB per device "
        f"({fits}){skip} | "
        f"step time {e.step_time_s:.4g} s | {e.tokens_per_s_per_gpu:,.0f} tokens/s per device | MFU {100 * e.mfu:.1f}%"
    )
    print("dry run: no ranks started, nothing written")
    return 2 if refused or not e.fits else 0
