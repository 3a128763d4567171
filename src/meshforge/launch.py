"""Start N local ranks through PyTorch's elastic launcher (whether torchrun started us is
``launch_env.under_launcher()``)."""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from meshforge.errors import ConfigError
from meshforge.launcher_tie import LAUNCHER_ENV


def check_nproc(nproc: int, device: str) -> None:
    """Refuse process counts this machine cannot reasonably run."""
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
        cores = os.cpu_count() or 1
        limit = max(8, 4 * cores)
        if nproc > limit:
            raise ConfigError(
                f"--nproc {nproc} CPU ranks on {cores} cores would thrash this machine; use at most {limit} "
                "(CPU ranks are for development and tests; use GPUs or torchrun across nodes for more)"
            )


def launch_local(nproc: int, child_argv: list[str], max_restarts: int = 0) -> int:
    """Run ``python -m meshforge <child_argv>`` on ``nproc`` local ranks; returns an exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--module",
            "meshforge",
            *child_argv,
        ]
    )
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process (launcher_tie.py)
    try:
        run(args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        code = exit_code_of(e)
        print(
            f"meshforge: {len(e.failures)} rank(s) failed (exit codes {codes}); see their output above",
            file=sys.stderr,
        )
        return code
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
    return 0


def exit_code_of(e: ChildFailedError) -> int:
    """The run's exit code, as docs/health.md documents it: 2 when a rank refused with a
    user-fixable error (a config, data or disk problem, a health stop), else 3 when a rank
    ended a hang, else 1. The other ranks' codes (killed by the agent, or exiting because
    they lost that peer) say nothing of the cause."""
    codes = {f.exitcode for f in e.failures.values()}
    for code in (2, 3):
        if code in codes:
            return code
    return 1
