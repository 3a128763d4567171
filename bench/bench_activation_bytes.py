"""Saved activation bytes, measured against the planner's model, in every mode a run can be in.

For each mode (recomputation none / selective / full x eager / compiled x fp32, bf16 by autocast,
bf16 cast once x the full or the chunked loss) the run's own model is built on a world of one as
`meshforge train` builds it, and one micro-batch goes forward (calibration/activation_probe.py):
a block's bytes are what one more block keeps, a token's what one more token costs (two depths x
two lengths). Printed per block and per token, and the model's ends (embedding ids, RoPE tables,
final norm, loss) per token, each against planner/activation_bytes.py, plus the whole forward at
a third length against the planner's per-token and fixed parts. No GPU; compiled modes run
inductor's partition of the joint graph (``--backend partition_only``, the default: no C++ code
generated) or the real inductor (``--backend inductor``: a compile per shape, minutes).

    python bench/bench_activation_bytes.py [--preset debug] [--backend inductor] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import time

from meshforge.calibration.activation_probe import measure_run, mode_overrides, per_block, planned, run_config

HOLDINGS = {
    "fp32": ("fp32", "autocast"),
    "bf16 autocast": ("bf16", "autocast"),
    "bf16 cast once": ("bf16", "cast_once"),
}
THIRD_SEQ = 448  # the whole forward at a length the fit did not use


def modes(quick: bool) -> list[dict]:
    """Every combination; --quick: the chunked loss only with compiled blocks, eager with the full logits."""
    out = []
    for ac, holding, compiled, chunk in itertools.product(
        ("none", "selective", "full"), HOLDINGS, (False, True), (0, 64)
    ):
        if quick and chunk != (64 if compiled else 0):
            continue
        precision, mixed = HOLDINGS[holding]
        out.append(
            dict(
                activation_checkpoint=ac,
                precision=precision,
                mixed_precision=mixed,
                compile=compiled,
                loss_chunk_size=chunk,
            )
        )
    return out


def describe(m: dict) -> str:
    holding = next(k for k, v in HOLDINGS.items() if v == (m["precision"], m["mixed_precision"]))
    loss = f"chunk {m['loss_chunk_size']}" if m["loss_chunk_size"] else "full logits"
    return f"{m['activation_checkpoint']:<9} {holding:<14} {'compiled' if m['compile'] else 'eager':<8} {loss:<11}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument(
        "--backend", default="partition_only", help="partition_only | inductor | aot_eager_decomp_partition"
    )
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    backend = None if a.backend == "inductor" else a.backend
    head = (
        f"{'mode':<45} {'block B/tok':>11} {'planner':>8} {'ratio':>6} {'ends B/tok':>10} {'planner':>8} {'ratio':>6}"
    )
    print(head + f" {'total@' + str(THIRD_SEQ):>10} {'ratio':>6} {'s':>5}")
    worst = 0.0
    for m in modes(a.quick):
        start = time.time()
        over = mode_overrides({"model.preset": a.preset}, **m)
        fit = per_block(over, backend=backend)
        block, ends = planned(run_config(over, 2, THIRD_SEQ))
        third = measure_run(run_config(over, 2, THIRD_SEQ), backend=backend).total
        fixed = 2 * fit.block_fixed + fit.ends_fixed  # (measured: weight copies, RNG states, head gradient)
        want = fixed + THIRD_SEQ * (2 * block + ends)
        r = (block / fit.block_per_token, ends / fit.ends_per_token, want / third)
        worst = max(worst, *(abs(x - 1) for x in r))
        print(
            f"{describe(m):<45} {fit.block_per_token:>11,.0f} {block:>8,.0f} {r[0]:>6.3f} {fit.ends_per_token:>10,.0f} "
            f"{ends:>8,.0f} {r[1]:>6.3f} {third:>10,} {r[2]:>6.3f} {time.time() - start:>5.0f}"
        )
    print(f"worst |planner / measured - 1|: {worst:.4f} (target: 0.03)")


if __name__ == "__main__":
    main()
