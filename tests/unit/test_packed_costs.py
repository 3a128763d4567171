"""What packed documents cost, as counted and as predicted: the expected attention span and the
ring's expected work (the planner's formulas) against what the code counts on random documents;
the planner's --mean-doc-len pricing; MFU over the executed FLOPs."""

import dataclasses

import numpy as np
import pytest
import torch

from meshforge.metrics.step_metrics import StepMetrics
from meshforge.metrics.step_result import StepResult
from meshforge.models.documents import Documents
from meshforge.models.flops import document_span, model_flops_per_token
from meshforge.models.presets import get_preset
from meshforge.parallel.context.document_ring import plan_ring
from meshforge.parallel.context.ring import chunk_ids
from meshforge.planner.context_costs import ring_block_work, ring_skipped_fraction
from meshforge.planner.estimate import estimate, plan_layout
from meshforge.planner.hardware import get_hardware


def poisson_lengths(rows, seq, mean, seed):
    """Each token starts a new document with probability 1 / mean (the formulas' model)."""
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        starts = np.flatnonzero(gen.random(seq) < 1 / mean)
        cuts = np.concatenate(([0], starts[starts > 0], [seq]))
        out.append(np.diff(cuts).tolist())
    return out


@pytest.mark.parametrize(("seq", "mean"), [(1024, 256), (8192, 1024), (512, 4096)])
def test_expected_span_matches_counted_spans(seq, mean):
    docs = Documents.from_lengths(poisson_lengths(400, seq, mean, seed=seq), seq)
    assert docs.span() == pytest.approx(document_span(seq, mean), rel=0.05)
    assert document_span(seq, 0) == seq and document_span(seq, 1e12) == pytest.approx(seq)


@pytest.mark.parametrize("balance", ["zigzag", "none"])
def test_ring_work_and_skips_match_the_plans(balance):
    """Each cp rank's expected ring work (and the share of blocks skipped) against the plans the
    ring runs, counted over 48 random sequences of one row each (a block runs masked for all its
    rows when one needs it); without documents, the causal ring's work."""
    seq, cp, mean, count = 1024, 4, 128, 48
    n = 2 * cp if balance == "zigzag" else cp
    rows = [Documents.from_lengths([r], seq) for r in poisson_lengths(count, seq, mean, seed=7)]
    plans = [[plan_ring(d, lambda r: chunk_ids(cp, r, balance), rank, cp, n) for d in rows] for rank in range(cp)]
    for rank, mine in enumerate(plans):
        counted = sum(p.work for p in mine) / count
        assert counted == pytest.approx(ring_block_work(seq, cp, balance, mean)[rank], rel=0.1, abs=0.05)
    every = [p for mine in plans for p in mine]
    skipped = sum(p.skipped for p in every) / sum(p.skipped + p.computed for p in every)
    assert skipped == pytest.approx(ring_skipped_fraction(seq, cp, balance, mean), abs=0.03)
    whole = Documents.from_lengths([[seq]], seq)
    causal = [plan_ring(whole, lambda r: chunk_ids(cp, r, balance), rank, cp, n).work for rank in range(cp)]
    assert causal == ring_block_work(seq, cp, balance)


def test_ring_at_the_benchmark_point_skips_over_40_percent():
    assert ring_skipped_fraction(8192, 4, "zigzag", 1024) > 0.4


def test_plan_prices_attention_under_document_masks():
    """--mean-doc-len: attention time falls (one device: by span / seq; under cp: the most loaded
    rank's ring blocks), tokens/s rise, and MFU counts the executed FLOPs."""
    shape = get_preset("llama3.2-1b")
    base = get_hardware("h100-sxm")
    docs = dataclasses.replace(base, mean_doc_len=1024.0)
    for lay in (plan_layout(dp=8), plan_layout(dp=2, cp=4)):
        plain, masked = (estimate(shape, lay, 8192, 8, "bf16", hw, 8) for hw in (base, docs))
        assert masked.step_time_s < plain.step_time_s
        assert masked.time["gemm"] < plain.time["gemm"]
        span = document_span(8192, 1024)
        tps = masked.tokens_per_s_per_gpu
        assert masked.mfu == pytest.approx(model_flops_per_token(shape, span) * tps / base.peak("bf16"))
    one, ring = (estimate(shape, lay, 8192, 8, "bf16", docs, 8) for lay in (plan_layout(dp=8), plan_layout(dp=2, cp=4)))
    assert one.time["gemm"] > 0 and ring.time["gemm"] > 0


class _Plan:
    """The parts of a run plan StepMetrics reads."""

    class train:  # noqa: N801
        global_batch_size, seq_len = 4, 64

    class layout:  # noqa: N801
        activation_checkpoint = "none"


def test_mfu_counts_the_executed_attention_flops():
    args = get_preset("debug")
    m = StepMetrics(_Plan, args, 1, 1e12, torch.device("cpu"))
    result = StepResult(torch.tensor(1.0), torch.tensor(1.0), 1e-3, True, global_loss=1.0)
    m.add(0.5, result)
    rec = m.record(1, 256, result, {"attention_span": 20.0})
    assert rec["mfu"] / rec["mfu_causal"] == pytest.approx(
        model_flops_per_token(args, 20.0) / model_flops_per_token(args, 64)
    )
    assert rec["attention_span"] == 20.0
    m.add(0.5, result)
    assert "mfu_causal" not in m.record(2, 512, result, {})
