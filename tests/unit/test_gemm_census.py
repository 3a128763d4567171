"""The GEMM census (metrics/gemm_census.py) and what it guards: one meshforge training step runs
exactly the GEMM FLOPs models/flops.py counts (6N·T + attention, plus the recomputation the config
asks for), kind by kind, eager and compiled; the census sees what FlopCounterMode misses."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshforge.config import load_config
from meshforge.metrics.gemm_census import GemmCensus, ModelDims, expected_flops
from meshforge.parallel.mesh import build_mesh
from meshforge.resolve import resolve
from meshforge.train.standalone_step import standalone_step

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 160, "vocab_size": 300}
CAST_ONCE = {"precision": "bf16", "mixed_precision": "cast_once"}  # the GPU recipe: FSDP2's bf16 params
SEQ, BATCH = 40, 2  # 80 tokens: no model dimension, so the kinds cannot be confused


def step_census(shape: dict[str, int] = SHAPE, **train: object) -> tuple[GemmCensus, dict[str, float]]:
    """One PlainStep (one micro-batch) of a tiny model under the census; the expected FLOPs per kind."""
    over = {f"model.{k}": v for k, v in shape.items()} | {"model.max_seq_len": SEQ, "train.seq_len": SEQ}
    over |= {"train.global_batch_size": BATCH, "train.micro_batch_size": BATCH, "train.device": "cpu"}
    over |= {"train.loss_chunk_size": 32} | {f"train.{k}": v for k, v in train.items()}
    plan = resolve(load_config(overrides=over), 1)
    built = standalone_step(plan, build_mesh(plan.layout, "cpu"))
    runner = built.runner
    batch = torch.randint(0, shape["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    if plan.train.compile:
        runner.run(batch, measure=False)  # compiles; the census sees the compiled code's aten calls
    census = GemmCensus(ModelDims.of_model(built.model, shape["vocab_size"], [BATCH * SEQ]))
    with census:
        runner.run(batch, measure=False)
    return census, expected_flops(plan.shape, BATCH * SEQ, SEQ, plan.layout.activation_checkpoint)


def assert_as_counted(census: GemmCensus, expected: dict[str, float]) -> None:
    got = census.totals()
    off = {k: (got[k], expected[k]) for k in got if got[k] != expected[k]}  # kind: (ran, counted)
    assert not off, (off, [r for r in census.rows() if r[0][0] == "other"])
    assert not census.unseen  # no higher-order op ran with GEMMs the census could not see


@pytest.mark.parametrize(
    "train",
    [
        {"precision": "bf16", "mixed_precision": "cast_once"},  # the GPU recipe: FSDP2 bf16 params, bf16 chunked head
        {"precision": "bf16", "mixed_precision": "autocast"},  # CPU's bf16 default
        {"precision": "fp32"},  # the chunked head's weight gradient by in-place addmm_
        {"precision": "fp32", "loss_chunk_size": 0},  # whole logits
        {"precision": "fp32", "activation_checkpoint": "full"},
        {"precision": "bf16", "mixed_precision": "cast_once", "activation_checkpoint": "selective"},
    ],
    ids=["bf16-cast_once", "bf16-autocast", "fp32-chunked", "fp32-whole-logits", "fp32-ac-full", "bf16-ac-selective"],
)
def test_eager_step_runs_exactly_the_counted_gemm_flops(train):
    census, expected = step_census(**train)
    assert_as_counted(census, expected)
    head = [r for r in census.records if r.kind == "head"]
    chunks = 1 if train.get("loss_chunk_size") == 0 else -(-BATCH * SEQ // 32)
    assert len(head) == 3 * chunks  # forward, input and weight gradient per chunk: nothing computed twice


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_hfu_numerator_is_what_a_step_runs(ac):
    """models/flops.hardware_flops_per_token (HFU's numerator, and the planner's) equals the GEMM and
    attention FLOPs a step runs, recomputation included: under full checkpointing neither the head
    nor any block's w2 runs again (it used to count both: ~9.7% high at 1B, seq 4096)."""
    from meshforge.models.flops import hardware_flops_per_token

    census, _ = step_census(precision="fp32", activation_checkpoint=ac)
    shape = resolve(load_config(overrides={f"model.{k}": v for k, v in SHAPE.items()}), 1).shape
    assert sum(census.totals().values()) == hardware_flops_per_token(shape, SEQ, ac) * BATCH * SEQ


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full"])
def test_compiled_step_runs_exactly_the_counted_gemm_flops(ac):
    census, expected = step_census(**CAST_ONCE, compile=True, activation_checkpoint=ac)
    assert_as_counted(census, expected)
    assert {r.op for r in census.records} >= {"mm"}  # inductor's extern mm calls, seen at run time


def test_a_compiled_step_after_another_head_count_in_the_same_process():
    """Dynamo traces dims that changed between compilations of one code object as symbols: once a
    model with other head counts was compiled in this process, ``q.shape[1] != k.shape[1]`` is a
    SymBool, which SDPA's ``enable_gqa`` refuses, and whole-block compilation makes that an error
    (CI met it when an earlier test file in the worker had compiled another shape)."""
    torch._dynamo.reset()
    try:
        for heads, kv_heads, hidden in ((8, 8, 64), (8, 4, 128), (4, 2, 64)):
            shape = SHAPE | {"heads": heads, "kv_heads": kv_heads, "hidden": hidden}
            assert_as_counted(*step_census(shape, **CAST_ONCE, compile=True))
    finally:
        torch._dynamo.reset()


def test_census_counts_in_place_addmm_that_flop_counter_misses():
    acc, a, b = torch.zeros(48, 16), torch.randn(48, 8), torch.randn(8, 16)
    census, counter = GemmCensus(), FlopCounterMode(display=False)
    with counter:
        acc.addmm_(a, b)
    with census:
        acc.addmm_(a, b)
    assert counter.get_total_flops() == 0
    assert census.totals()["other"] == 2 * 48 * 8 * 16
    assert "in place" in census.records[0].notes[0]


def test_kinds_of_a_linear_and_a_duplicate_matmul_shows():
    lin = nn.Linear(24, 40, bias=False)
    dims = ModelDims.of_model(nn.ModuleList([lin, nn.Linear(24, 100, bias=False)]), 100, [12])
    x = torch.randn(12, 24, requires_grad=True)
    census = GemmCensus(dims)
    with census:
        lin(x).sum().backward()
    assert [r.kind for r in census.records] == ["forward", "input_grad", "weight_grad"] or [
        r.kind for r in census.records
    ] == ["forward", "weight_grad", "input_grad"]
    assert set(census.totals().values()) == {0, 2 * 12 * 24 * 40}
    with census:  # a second, unneeded product: the forward count doubles
        (lin(x) + x @ lin.weight.T).sum().backward()
    assert census.totals()["forward"] == 3 * 2 * 12 * 24 * 40


def test_token_count_equal_to_a_model_dimension_is_refused():
    with pytest.raises(ValueError, match="token counts"):
        ModelDims.of_model(nn.ModuleList([nn.Linear(24, 40), nn.Linear(24, 100)]), 100, [40])


def test_flex_attention_is_counted_as_attention():
    from torch.nn.attention.flex_attention import flex_attention

    q, k = torch.randn(1, 4, 32, 16), torch.randn(1, 2, 32, 16)
    census = GemmCensus()
    with census:
        flex_attention(q, k, k, enable_gqa=True)  # (CPU: forward only; a higher-order op, not aten)
    assert [(r.kind, r.flops) for r in census.records] == [("attention", 4 * 4 * 32 * 32 * 16)]
