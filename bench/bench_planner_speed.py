"""How long a full planner search takes at the largest scale the issue names: Llama 3.1 405B
on 16,384 H100 (seq 8192, global batch 2048), every choice searched. Target: under 10 s.
Printed, not asserted (timings on a shared machine are noisy).

    python bench/bench_planner_speed.py
"""

from __future__ import annotations

import os
import time

from meshforge.config.layout import open_layout
from meshforge.planner.hardware import get_hardware
from meshforge.planner.model_flags import from_preset
from meshforge.planner.search import search


def main() -> None:
    shape, hw = from_preset("llama3.1-405b"), get_hardware("h100-sxm")
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cases = (
        ("open search", open_layout()),
        ("schedule fixed (interleaved)", open_layout(pp_schedule="interleaved_1f1b")),
    )
    for label, fixed in cases:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            results, considered = search(shape, hw, 16384, 8, 2048, 8192, "bf16", fixed)
            times.append(time.perf_counter() - t0)
        best = results[0].layout
        print(
            f"{label:<30} {considered:>6} layouts considered, {len(results):>5} ranked, "
            f"best {min(times):.2f} s / median {sorted(times)[1]:.2f} s (target < 10 s); "
            f"best layout tp {best.tp} pp {best.pp} dp {best.dp} zero {best.zero_stage} mb {best.micro_batch_size} "
            f"{best.activation_checkpoint} {best.pp_schedule}, MFU {100 * results[0].mfu:.1f}%"
        )


if __name__ == "__main__":
    main()
