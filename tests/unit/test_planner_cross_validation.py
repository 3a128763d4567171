"""Issue 51: the planner on runs it was not fitted to. bench/bench_planner_published.py's leave-one-
source-out check refits the constants the planner fits to published runs on every source but one and
predicts that one; the error a source the constants never saw gets is the planner's, not the
in-sample one. Pure modelling (seconds)."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_planner_published as published  # noqa: E402

# the one row over the target, and why (docs/planner.md, "What is left"): memory pressure at the
# edge of the device, which the planner does not model; the same run at 4K fits within 0.2 points
OVER = {"MPT 30B, 8 H100, s8k ckpt"}


def test_every_source_held_out_in_turn_is_predicted_within_the_target(capsys):
    """The A100 sources (Megatron's N21 and K22, MPT's A100 table) agree on one GEMM share once the
    A100's GEMMs are priced by their smallest dimension and its attention at FlashAttention-2's
    rates: each held out is within 8 points (before: MPT's A100 rows 11.6 off, N21's 8.7)."""
    held = published.cross_validate()
    capsys.readouterr()
    errors = {run: e for pairs in held.values() for run, e in pairs}
    assert len(errors) == 36 and set(held) >= {"N21", "K22", "MPT A100", "MPT H100", "L3"}
    assert statistics.median(abs(e) for e in errors.values()) <= 3.0
    for source in ("N21", "K22", "MPT A100"):
        assert max(abs(e) for _, e in held[source]) <= 8.0, (source, held[source])
    assert max(abs(e) for run, e in errors.items() if run not in OVER) <= 8.0
