"""Ranks that die with their launcher: ``meshforge train --nproc N`` owns the ranks it starts.

torch.distributed.run's elastic agent runs inside the launcher's process and starts each rank
in a session of its own, so neither a SIGKILL of the launcher nor of its process group reaches
the ranks: they would train on as orphans, two writers in one run directory once the user
starts the run again. The launcher therefore exports its PID (``LAUNCHER_ENV``), and each rank
it started asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux) and
keeps a watchdog thread that polls its parent PID (other systems, and a parent that died
before the request). Ranks that torchrun started (no ``LAUNCHER_ENV``) are left alone: their
agent supervises them, across nodes.

The launcher also hands its ranks the run plan its pre-flight accepted (``PLAN_ENV``, the
plan as JSON): they train on that verdict instead of resolving and checking again. A rank
takes it only from its own launcher (``handed_plan``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

from meshforge.errors import ConfigError

LAUNCHER_ENV = "MESHFORGE_LAUNCHER_PID"
PLAN_ENV = "MESHFORGE_RUN_PLAN"  # the launcher's run plan (RunPlan.to_json), for its ranks
PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def _parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when this process's parent exits; False where not Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with(launcher: int, parent: int) -> None:
    while True:
        threading.Event().wait(POLL_S)
        if os.getppid() != parent or not alive(launcher):
            os.kill(os.getpid(), signal.SIGKILL)


def tie_to_launcher() -> bool:
    """In a rank that meshforge's own launcher started: die when the launcher dies. Returns
    whether it did anything (False under torchrun or a plain process)."""
    raw = os.environ.get(LAUNCHER_ENV, "")
    if not raw.isdigit() or "LOCAL_RANK" not in os.environ:  # a rank, started by meshforge's launcher
        return False
    launcher, parent = int(raw), os.getppid()
    if parent == launcher:
        _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent or not alive(launcher):  # gone already: no signal will ever come
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_die_with, args=(launcher, parent), name="meshforge-launcher-tie", daemon=True).start()
    return True


def alive(pid: int) -> bool:
    """Whether ``pid`` exists (a zombie counts as gone only once reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def handed_plan() -> str | None:
    """The run plan (JSON) that ``meshforge train --nproc N``'s launcher handed this rank, or None
    when none was. One in the environment of a process that launcher did not start (its PID is
    not our parent's) is refused, never trusted: it would skip every pre-flight check."""
    text = os.environ.get(PLAN_ENV)
    if text is None:
        return None
    if "LOCAL_RANK" not in os.environ or os.environ.get(LAUNCHER_ENV, "") != str(os.getppid()):
        raise ConfigError(
            f"{PLAN_ENV} is set, but this process is not a rank started by `meshforge train --nproc N`; "
            f"unset {PLAN_ENV} (it is the launcher's hand-over to its ranks)"
        )
    return text
