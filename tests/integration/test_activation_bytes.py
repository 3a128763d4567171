"""Saved activation bytes: the counting (calibration/saved_activations.py) and the planner's
per-block and per-token model (planner/activation_bytes.py) held to what the run's own model
keeps, mode by mode, within 3% (calibration/activation_probe.py builds it as training does).
The full matrix, with the real inductor too: bench/bench_activation_bytes.py."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshforge.calibration.activation_probe import mode_overrides, per_block, planned, run_config
from meshforge.calibration.saved_activations import measure


def test_views_count_once_and_parameters_not_at_all():
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def forward():
        h = x @ w.t()  # mm keeps x and a view of w: w's storage is a weight
        t = h.tanh()  # keeps its output
        return (t.view(32) * t.view(32)).sum()  # two views of t's storage: once

    got = measure(forward, [w], eager=True)
    assert got.total == x.nbytes + 4 * 8 * 4, got.table()


def test_a_checkpoint_keeps_its_input_and_a_selective_one_its_cache():
    w = nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def block(a):
        return (a @ w).relu().exp().sum()

    full = measure(lambda: checkpoint(block, x, use_reentrant=False), [w], eager=True)
    assert full.total == x.nbytes, full.table()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def sac():
        ctx = create_selective_checkpoint_contexts(policy)
        return checkpoint(block, x, use_reentrant=False, context_fn=lambda: ctx)

    kept = measure(sac, [w], eager=True)  # the matmul's output lives in the checkpoint's own cache
    assert kept.total == x.nbytes + 4 * 16 * 4, kept.table()
    assert {r[3] for r in kept.table()} == {"hook", "held"}


# (recomputation, precision, mixed precision, compiled, loss chunk): every recomputation and
# precision eager; compiled, all three recomputations where GPUs run (bf16 cast once) and no
# recomputation in the other two; the chunked and the full loss in each group
EAGER_AC = (("none", 0), ("selective", 64), ("full", 0))
HOLDINGS = (("fp32", "autocast"), ("bf16", "autocast"), ("bf16", "cast_once"))
MODES = [(ac, p, mp, False, chunk) for p, mp in HOLDINGS for ac, chunk in EAGER_AC]
MODES += [(ac, "bf16", "cast_once", True, chunk) for ac, chunk in (("none", 64), ("selective", 0), ("full", 64))]
MODES += [("none", "fp32", "autocast", True, 0), ("none", "bf16", "autocast", True, 64)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=["-".join(map(str, m)) for m in MODES])
def test_planner_equals_the_measured_bytes_per_block_and_token(mode):
    ac, precision, mixed, compiled, chunk = mode
    keys = dict(activation_checkpoint=ac, precision=precision, mixed_precision=mixed, compile=compiled)
    over = mode_overrides({"model.preset": "debug"}, **keys, loss_chunk_size=chunk)
    fit = per_block(over, backend="partition_only" if compiled else None)
    block, ends = planned(run_config(over, 2, 256))
    assert block == pytest.approx(fit.block_per_token, rel=0.03), (fit.block_per_token, block)
    assert ends == pytest.approx(fit.ends_per_token, rel=0.03), (fit.ends_per_token, ends)
