"""Run the equivalence tests (or the whole suite) under every CPU capability this machine can
dispatch to, so a tolerance fitted to one CPU's summation order shows up before a user's CPU
finds it.

PyTorch picks its vectorised kernels by ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``,
``avx512``); setting it lower than the CPU's own makes this machine sum the way older or smaller
CPUs do. Each capability gets its own ``TORCHINDUCTOR_CACHE_DIR``: torch's on-disk inductor cache
is not keyed by the capability, and code compiled under one and loaded under another gave a
compiled loss of ``nan``, a ``double free`` and a loss 13% off. Tests that hit the limits of the
emulation itself (inductor still emits code for the real CPU) are skipped under that emulation
only, by tests/conftest.py, with the reason.

    python scripts/every_cpu.py                  # the equivalence tests, every capability
    python scripts/every_cpu.py --whole          # the whole suite (once per release)
    python scripts/every_cpu.py --only avx2 -- -x tests/integration/test_train.py   # extra pytest arguments

Prints one line per capability and exits 1 if any run failed. Not part of README's suite: it
takes about 3 x the equivalence tests' time (see docs/running.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the equivalence tests: a layout (or path) against the single-process reference
EQUIVALENCE = "single_process or matches or equals or equivalen"
ORDER = ("default", "avx2", "avx512")


def capabilities() -> list[str]:
    """Those this CPU can run: every capability up to the one torch detects."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    native = out.stdout.strip().lower()
    top = ORDER.index(native) if native in ORDER else ORDER.index("avx2") if "avx2" in native else 0
    return list(ORDER[: top + 1])


def run_one(cap: str, pytest_args: list[str], cache_root: Path) -> tuple[int, float]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "TORCHINDUCTOR_CACHE_DIR": str(cache_root / f"inductor-{cap}")}
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env).returncode
    return rc, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--whole", action="store_true", help="the whole suite, not only the equivalence tests")
    p.add_argument("--only", choices=ORDER, action="append", help="run this capability only (repeatable)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0 = one process)")
    p.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments (they replace the selection)")
    a = p.parse_args(argv)
    caps = capabilities()
    chosen = [c for c in caps if not a.only or c in a.only]
    missing = sorted(set(a.only or ()) - set(caps))
    if missing:
        print(f"this CPU cannot run {', '.join(missing)} (it has {', '.join(caps)}); skipped", file=sys.stderr)
    args = ["-q"] + (["-n", str(a.workers), "--dist", "loadfile"] if a.workers else [])
    args += a.pytest_args or ([] if a.whole else ["-k", EQUIVALENCE])
    results = []
    with tempfile.TemporaryDirectory(prefix="meshforge-every-cpu-") as tmp:
        for cap in chosen:
            print(f"== ATEN_CPU_CAPABILITY={cap}: pytest {' '.join(args)}", flush=True)
            results.append((cap, *run_one(cap, args, Path(tmp))))
    for cap, rc, secs in results:
        print(f"{cap:>8}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {secs / 60:.1f} min")
    return 0 if results and all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
