"""Start N local ranks through PyTorch's elastic launcher (whether torchrun started us is
``launch_env.under_launcher()``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from meshforge.errors import ConfigError
from meshforge.launch import env as launch_env
from meshforge.launch import startup_gc
from meshforge.launch.tie import LAUNCHER_ENV, PLAN_ENV


def check_nproc(nproc: int, device: str) -> None:
    """Refuse process counts this machine cannot reasonably run; warn of CPU ranks that outnumber the cores."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        n = torch.cuda.device_count()
        if n == 0:
            raise ConfigError(
                "train.device = 'cuda' but no CUDA device is visible on this machine; "
                "use --train.device cpu (or auto: CUDA when there is one, else CPU)"
            )
        if nproc > n:
            raise ConfigError(f"--nproc {nproc} is more than the {n} visible GPUs; use --nproc {n} or fewer")
    else:
        cores = launch_env.cpu_cores()
        limit = max(8, 4 * cores)
        if nproc > limit:
            raise ConfigError(
                f"--nproc {nproc} CPU ranks on {cores} cores would thrash this machine; use at most {limit} "
                "(CPU ranks are for development and tests; use GPUs or torchrun across nodes for more)"
            )
        if launch_env.oversubscribed("cpu", nproc):
            print(
                f"meshforge: warning: --nproc {nproc} CPU ranks on {cores} cores: the ranks take turns on the cores, "
                f"so expect no speed-up over --nproc {cores}, and the straggler check is off (it would time the "
                "sharing, not a slow rank)",
                file=sys.stderr,
                flush=True,
            )


def launch_local(nproc: int, child_argv: list[str], max_restarts: int = 0, plan: str | None = None) -> int:
    """Run ``python -m meshforge <child_argv>`` on ``nproc`` local ranks; returns an exit code.
    ``plan``: the run plan (JSON) the ranks train on (launch/tie.py's ``handed_plan``)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    parser = get_args_parser()
    forward = Path("/proc/self/stat").exists() and "--signals-to-handle" in parser._option_string_actions
    own = ["--signals-to-handle=SIGHUP,SIGQUIT"] if forward else []  # SIGINT/SIGTERM: ours (StopForwarding)
    args = parser.parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            *own,
            "--module",
            "meshforge",
            *child_argv,
        ]
    )
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process (launch/tie.py)
    if plan is not None:
        os.environ[PLAN_ENV] = plan
    stop = StopForwarding(forward)
    startup_gc.resume()  # the launcher now waits on its ranks, for as long as they train
    try:
        with stop:
            run(args)
    except ChildFailedError as e:
        print(failure_line(e, stop.requested), file=sys.stderr)
        return exit_code_of(e, stop.requested)
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
        os.environ.pop(PLAN_ENV, None)
    return 0


class StopForwarding:
    """Ctrl-C and SIGTERM at the launcher reach its ranks as they reach a single process: each
    rank finishes a step, saves what it has and exits 0 (train/stop.py), the launcher waits for
    them and exits 0 too. torch's agent would instead raise a SignalException (exit 1, a
    traceback) and kill the ranks after 30 s; it is told to leave these two signals to us. A
    signal before any rank started aborts (KeyboardInterrupt: exit 130). Linux (/proc) only;
    elsewhere torch's handling stays."""

    def __init__(self, active: bool) -> None:
        self.active, self.requested = active, 0
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopForwarding:
        if self.active:
            self._old = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _forward(self, signum: int, frame: object) -> None:
        ranks = child_pids()
        if not ranks:
            raise KeyboardInterrupt
        self.requested += 1
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def child_pids() -> list[int]:
    """The processes whose parent is this one (a launcher's ranks: torch's agent runs in-process)."""
    me, out = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # after the command name (which may hold spaces)
            out.append(int(entry.name))
    return out


def failure_line(e: ChildFailedError, stop_requested: int = 0) -> str:
    """The launcher's one line on failed ranks. Ranks a stop ended by its signal (a negative exit
    code) had not yet installed their own handler -- they were starting -- and printed nothing."""
    codes = sorted({f.exitcode for f in e.failures.values()})
    if stop_requested and all(c < 0 for c in codes):
        names = ", ".join(_signal_name(-c) for c in codes)
        return (
            f"meshforge: stopped ({names}) while its {len(e.failures)} rank(s) were starting, before they could "
            "stop cleanly; nothing was trained (a new run directory that held nothing but config.toml is removed)"
        )
    return f"meshforge: {len(e.failures)} rank(s) failed (exit codes {codes}); see their output above"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code_of(e: ChildFailedError, stop_requested: int = 0) -> int:
    """The run's exit code, as docs/health.md documents it: 2 when a rank refused with a
    user-fixable error (a config, data or disk problem, a health stop), else 3 when a rank
    ended a hang, else 130 when a stop was asked for (Ctrl-C twice: aborted), else 1. The
    other ranks' codes (killed by the agent, or exiting because they lost that peer) say
    nothing of the cause."""
    codes = {f.exitcode for f in e.failures.values()}
    for code in (2, 3):
        if code in codes:
            return code
    return 130 if stop_requested else 1
