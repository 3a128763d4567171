"""The fuzz of issue 50 with a long budget: seeded, bounded mutations of the four manifests
meshforge reads (a config, a prepared corpus's index.json, a checkpoint's meta.json and its
.metadata), each run through its real command in this process (tests/manifest_fuzz.py says how).

Prints, per manifest and in all: inputs run, exit 0, exit 2 with one paragraph, and the
failures -- tracebacks, hangs (over 30 s), writes outside the run directory, other exit codes or
more than one paragraph -- with the seconds per input. Targets: >= 10,000 inputs in all, 0
failures, and the slowest input under 30 s. The first failures are printed with the input
that caused them.

    PYTHONPATH=src:tests python bench/bench_manifest_fuzz.py [--examples 3000 --config-examples 1000] [--seed 0]
        [--targets config,index,meta,metadata]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from manifest_fuzz import TARGETS, Tally, fuzz, make_workspace  # noqa: E402


def corpus(root: Path) -> Path:
    """The test suite's corpus: a few of this Python's standard-library sources."""
    std = Path(sysconfig.get_paths()["stdlib"])
    d = root / "corpus"
    d.mkdir()
    for name in ("argparse.py", "dataclasses.py", "difflib.py", "textwrap.py", "json/decoder.py"):
        shutil.copy(std / name, d / Path(name).name)
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=3000, help="mutated inputs per manifest")
    ap.add_argument("--config-examples", type=int, default=1000, help="for the config (each trains a step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(TARGETS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mf-fuzz-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("MESHFORGE_CACHE", str(root / "cache"))
        (root / "ws").mkdir()
        ws = make_workspace(root / "ws", corpus(root))
        tally, t0 = Tally(), time.perf_counter()
        print(
            f"{'manifest':<10} {'inputs':>7} {'exit 0':>7} {'exit 2':>7} {'failures':>9} {'s/input':>8} {'slowest':>8}"
        )
        for target in args.targets.split(","):
            one = Tally()
            fuzz(ws, target, args.config_examples if target == "config" else args.examples, args.seed, one)
            n, bad = one.total(), one.total() - one.total("exit 0") - one.total("exit 2")
            print(
                f"{target:<10} {n:>7} {one.total('exit 0'):>7} {one.total('exit 2'):>7} {bad:>9} "
                f"{one.seconds / max(n, 1):>8.3f} {one.slowest:>7.1f}s"
            )
            tally.counts.update(one.counts)
            tally.failures += one.failures
            tally.slowest = max(tally.slowest, one.slowest)
        n = tally.total()
        kinds = sorted({k for _, k in tally.counts})
        print(f"{'all':<10} {n:>7} {tally.total('exit 0'):>7} {tally.total('exit 2'):>7} {len(tally.failures):>9}")
        print("by kind: " + ", ".join(f"{k} {tally.total(k)}" for k in kinds))
        print(
            f"slowest input {tally.slowest:.1f} s; wall time {time.perf_counter() - t0:.0f} s; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        for f in tally.failures[:10]:
            print("FAILURE", f[:1500])
        ok = n >= 10_000 or args.examples * 3 + args.config_examples < 10_000
        return 0 if not tally.failures and ok else 1


if __name__ == "__main__":
    sys.exit(main())
