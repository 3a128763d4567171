"""``meshforge train``: its arguments (``--section.key=value`` overrides beside --config,
--nproc, --max-restarts, --dry-run), the launch (in this process, or N local ranks through
torch.distributed.run) and, on rank 0, the run report written whatever the outcome. Imported
only when the command is ``train`` (cli/main.py keeps ``meshforge --help`` free of torch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError, MeshforgeError, suggest
from meshforge.guards.disk import check_name_length
from meshforge.launch import env as launch_env
from meshforge.launch.tie import tie_to_launcher

TRAIN_USAGE = """usage: meshforge train [--config FILE.toml] [--nproc N] [--max-restarts K] [--dry-run]
                       [--section.key=value ...]

Train a model. Any config key can be overridden as --section.key=value or --section.key value,
e.g. --train.steps=100 --model.preset llama3.2-1b --optim.lr 3e-4. See README.md, configs/ for
examples and docs/configuration.md for what each key means.

  --config FILE      a TOML config (a run's config.toml reproduces that run)
  --nproc N          local ranks to start (default 1; under torchrun leave it out)
  --max-restarts K   restart the ranks up to K times after a failure, resuming from the last checkpoint
  --dry-run          resolve the config for --nproc ranks, print it and the planner's estimate, and exit

config keys (type, default):"""

_TRAIN_FLAGS = ("--config", "--nproc", "--max-restarts", "--dry-run", "--help")
_COUNTS = {  # flag -> (lowest, highest, what it counts)
    "nproc": (1, 4096, "the local ranks to start; under torchrun leave it out"),
    "max-restarts": (0, 10_000, "restarts after a failure; 0: none"),
}


def parse_train_args(argv: list[str]) -> tuple[str | None, int, int, dict[str, Any]]:
    """Split ``train`` arguments into (config file, nproc, max restarts, {section.key: value});
    ``--dry-run`` is read by ``cmd_train`` itself."""
    from meshforge.config import key_type, parse_value

    config, nproc, restarts = None, 1, 0
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
        elif name in ("nproc", "max-restarts"):
            lo, hi, what = _COUNTS[name]
            try:
                n = int(value)
            except ValueError:
                raise ConfigError(f"--{name} takes a whole number, got '{value}'") from None
            if not lo <= n <= hi:
                raise ConfigError(f"--{name} {n} must be between {lo} and {hi} ({what})")
            if name == "nproc":
                nproc = n
            else:
                restarts = n
        elif "." in name:
            parsed = parse_value(value)
            # a text key takes the text as written: --run.dir=1, --run.dir nan, --data.path true
            overrides[name] = value if key_type(name) is str and not isinstance(parsed, str) else parsed
        else:
            raise ConfigError(
                f"unknown option --{name}; {suggest('--' + name, _TRAIN_FLAGS, cutoff=0.6)} "
                "(or a --section.key=value config override)"
            )
    return config, nproc, restarts, overrides


def cmd_train(argv: list[str]) -> int:
    tie_to_launcher()  # a rank that `meshforge train --nproc N` started dies with it (nothing under torchrun)
    if "--help" in argv or "-h" in argv:
        from meshforge.cli.help_text import fit, terminal_width
        from meshforge.config.reference import describe_keys

        print(fit(TRAIN_USAGE, terminal_width()))
        print(describe_keys(terminal_width()))
        return 0
    from meshforge.guards import run_lock

    early = run_lock.run_dir_in_argv(argv)
    if early:
        check_name_length(Path(early))  # (a name too long for the filesystem cannot even be looked up)
    if early and "--dry-run" not in argv and not launch_env.under_launcher() and Path(early).is_dir():
        run_lock.hold(Path(early))  # a second run into a busy run.dir is refused here, before torch loads
    try:
        return _train(argv)
    finally:
        if early:
            run_lock.release(Path(early))  # (a no-op when the run released it itself)


def _train(argv: list[str]) -> int:
    """``meshforge train`` once run.dir is locked: in this process, or launching the ranks."""
    from meshforge.config import load_config
    from meshforge.guards import run_lock

    config_file, nproc, restarts, overrides = parse_train_args(argv)
    cfg = load_config(config_file, overrides)
    if "--dry-run" in argv:
        return dry_run(cfg, nproc if "--nproc" in " ".join(argv) else launch_env.world_size())
    if restarts and (cfg.checkpoint.interval == 0 or cfg.checkpoint.load == "none"):
        raise ConfigError(
            f"--max-restarts {restarts}: a restarted group resumes from the last complete checkpoint, so it needs "
            'checkpoint.interval > 0 (or "auto") and checkpoint.load = latest; e.g. --checkpoint.interval=100'
        )
    from meshforge.guards.preflight import preflight
    from meshforge.launch.local import check_nproc, launch_local

    if launch_env.under_launcher():
        if nproc > 1:
            raise ConfigError("--nproc starts ranks itself; under torchrun leave it out (torchrun sets the ranks)")
        summary = train_and_report(cfg)
        return 0 if summary else 1
    check_nproc(nproc, cfg.train.device)
    if nproc == 1 and not restarts:
        train_and_report(cfg)
        return 0
    # Check everything (config, run dir, data) once here, before any rank starts.
    cfg = preflight(cfg, nproc, launcher=True).config
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    run_lock.hold(Path(cfg.run.dir))  # the launcher holds it across restarts; its ranks know (HELD_ENV)
    os.environ[run_lock.HELD_ENV] = str(Path(cfg.run.dir).resolve())
    child = ["train"]
    if config_file:
        child += ["--config", config_file]
    child += [
        f"--{k}={v}" if not isinstance(v, (list, bool)) else f"--{k}={str(v).lower()}"
        for k, v in overrides.items()
        if k != "run.dir"
    ]
    child.append(f"--run.dir={cfg.run.dir}")
    try:
        return launch_local(nproc, child, restarts)
    finally:
        os.environ.pop(run_lock.HELD_ENV, None)
        run_lock.release(Path(cfg.run.dir))


def train_and_report(cfg: Any) -> dict[str, Any]:
    """Train on this rank, then (rank 0) write run.dir/report.html from whatever the run
    wrote, also after a failed or stopped run. Written here, above train/, so that training
    never imports the analysis side (report/ reads the planner). Rank 0 checks the run first
    (as the multi-rank launch does): a refused run writes nothing, not even into an old run."""
    from meshforge.guards.preflight import launch_plan
    from meshforge.train import train

    plan = launch_plan(cfg, launch_env.world_size())  # a refusal here has written nothing, not even a report
    try:
        return train(plan)
    finally:
        if launch_env.rank() == 0:  # under torchrun, rank 0's dir is the run's
            write_run_report(plan)


def write_run_report(cfg: Any) -> None:
    """run.dir/report.html (unless metrics.report = false); a report error is logged as an
    event (``report_failed``), never raised over the run's own outcome."""
    from meshforge.guards.disk import describe
    from meshforge.report import write_report
    from meshforge.train.run_dir import event_writer

    run_dir = Path(cfg.run.dir)
    if not cfg.metrics.report or not ((run_dir / "metrics.jsonl").is_file() or (run_dir / "events.jsonl").is_file()):
        return
    try:
        write_report([run_dir], run_dir / "report.html")
    except Exception as e:  # noqa: BLE001 - the report must never hide the training outcome
        why = describe(run_dir / "report.html", e, "write") if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        print(f"meshforge: note: report.html skipped ({why})", file=sys.stderr)
        try:
            event_writer(cfg.run.dir)("report_failed", error=why[:2000])
        except OSError:
            pass


def dry_run(cfg: Any, world: int) -> int:
    """Print the run plan for ``world`` ranks on this machine (the config.toml a run would write),
    the device and its memory, and the planner's estimate of exactly that layout on it (the one
    the pre-flight fit check uses); start nothing and write nothing (run.dir is not touched)."""
    from meshforge.guards.memory_fit import device_memory, estimate_run
    from meshforge.resolve import resolve

    plan = resolve(cfg, world, machine=False)
    print(f"# meshforge train --dry-run: the run plan for {world} rank(s)\n{plan.to_toml()}")
    try:  # what only the machine decides (CPU offload needs a GPU, fp8 needs torchao)
        resolve(cfg, world)
    except MeshforgeError as e:
        print(f"on this machine meshforge train refuses it: {e}")
    cuda = plan.world.device == "cuda"
    mem = device_memory(cuda, 0, 1 if cuda else world)
    print(f"device: {mem.describe()}" + (" (GPU 0; each rank checks its own)" if cuda and world > 1 else ""))
    run = estimate_run(plan, mem)
    e = run.estimate
    if e is None:
        print(f"planner: no estimate for this layout ({run.error})")
        return 0
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
    return 0
