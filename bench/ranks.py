"""Run a benchmark script again as its own worker ranks: one process for one rank, torchrun's
standalone launcher for more, each rank given an equal share of the cores."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def run_workers(script: str, args: argparse.Namespace, ranks: int) -> int:
    """``script --worker`` with every other flag of ``args`` passed on; its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"]
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.run([*launch, script, "--worker", *flags], env=env).returncode
