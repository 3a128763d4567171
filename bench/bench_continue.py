"""Issue 53's continuation target on the main job: README command 1 (configs/debug.toml, 400
steps, wsd), then the command its last line prints with ``--train.steps=800``, in one sitting.

It prints whether the curve goes on from step 400 without a jump (the first loss after 400
against the last before it, in the extended curve and against the loss the 400-step run showed),
that the run ends at step 800 in the same run directory, and the validation loss at 400 and at
800. Ratios only: the wall times depend on the machine and its load (printed beside them).

    python bench/bench_continue.py                    # runs/bench-continue (replaced)
    python bench/bench_continue.py --dir /tmp/cont --steps 800
    python bench/bench_continue.py --first 100 --steps 200   # the same run scaled down (a busy machine)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path


def meshforge(args: list[str]) -> tuple[str, float]:
    """Run ``meshforge ARGS`` (this Python), fail loudly, return its stdout and wall time."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "meshforge", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"meshforge {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout, time.perf_counter() - t0


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def val_losses(run: Path) -> dict[int, float]:
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["val_loss"] for e in events if e["event"] == "eval"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/bench-continue")
    p.add_argument("--first", type=int, default=400, help="the first run's train.steps (the main job: 400)")
    p.add_argument("--steps", type=int, default=800, help="the step the printed command extends it to")
    a = p.parse_args()
    run = Path(a.dir)
    shutil.rmtree(run, ignore_errors=True)
    load0 = os.getloadavg()[0]
    first_run = ["train", "--config", "configs/debug.toml", "--run.dir", str(run), f"--train.steps={a.first}"]
    out, t_first = meshforge(first_run)
    last = out.strip().splitlines()[-1]
    printed = shlex.split(last[last.index("meshforge train") :])[1:]
    print(f"last line of the {a.first}-step run: {last}")
    first, val_first = losses(run), val_losses(run)
    end = max(first)
    command = [*[w for w in printed if not w.startswith("--train.steps")], f"--train.steps={a.steps}"]
    out, t_more = meshforge(command)
    print("\n".join(line for line in out.splitlines() if "resumed from" in line or "optim.schedule" in line))
    more, val_more = losses(run), val_losses(run)
    after = min(s for s in more if s > end)
    print(f"run directory: {run} (the same for both); steps recorded: {min(more)}-{max(more)}")
    print(f"loss at step {after} / loss at step {end}, extended curve: {more[after] / more[end]:.4f}")
    print(f"loss at step {after} / loss the {end}-step run ended with: {more[after] / first[end]:.4f}")
    print(f"val loss at step {end}: {val_first[end]:.4f}; at step {max(more)}: {val_more[max(more)]:.4f}")
    print(f"val loss ratio {max(more)}/{end}: {val_more[max(more)] / val_first[end]:.4f}")
    print(f"wall: {t_first:.0f} s, then {t_more:.0f} s (load average {load0:.1f} -> {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
