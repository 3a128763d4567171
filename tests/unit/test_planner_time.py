"""The planner's time terms from first principles (issue 28): ZeRO-1 as a distributed
optimizer, async TP's hidden share, the output head in the slowest pipeline stage,
interleaving only where Megatron runs it, and the async_tp rule."""

from __future__ import annotations

import pytest

from meshforge.config.layout import open_layout
from meshforge.errors import ConfigError
from meshforge.parallel import rules
from meshforge.parallel.rules import Batch
from meshforge.planner import time_terms
from meshforge.planner.candidates import schedules as _schedules
from meshforge.planner.comm_time import (
    collective_time,
    dp_after_step,
    dp_exposed,
    dp_time,
    last_reduction_share,
    pp_time,
)
from meshforge.planner.estimate import estimate, plan_layout
from meshforge.planner.hardware import get_hardware
from meshforge.planner.memory import stage_params
from meshforge.planner.model_flags import from_preset

H100 = get_hardware("h100-sxm")
SHAPE = from_preset("llama3.1-8b")


def test_zero1_is_a_reduce_scatter_plus_an_all_gather():
    lay = plan_layout(1, 1, 8, zero_stage=1)
    psi = stage_params(SHAPE, 1, 1)[0]
    rs = collective_time(H100, "reduce_scatter", 4 * psi, 1, 8, 8)
    ag = collective_time(H100, "all_gather", 2 * psi, 1, 8, 8)
    assert dp_time(SHAPE, lay, "bf16", H100, 8) == pytest.approx(rs + ag)
    ddp = dp_time(SHAPE, plan_layout(1, 1, 8, zero_stage=0), "bf16", H100, 8)
    assert dp_time(SHAPE, lay, "bf16", H100, 8) == pytest.approx(0.75 * ddp, rel=0.01)  # 6 of 8 bytes
    bf16 = dp_time(SHAPE, lay.replace(grad_reduce_dtype="bf16"), "bf16", H100, 8)
    assert bf16 == pytest.approx(0.5 * ddp, rel=0.01)  # 4 of 8 bytes: a bf16 all-reduce's


def test_async_tp_hides_what_the_neighbouring_gemms_cover():
    args = (SHAPE, 4096, 8, "bf16", H100, 8)
    lay = plan_layout(8, 1, 1, micro_batch_size=1, num_microbatches=1)
    off, on = estimate(SHAPE, lay, *args[1:]), estimate(SHAPE, lay.replace(async_tp=True), *args[1:])
    assert off.time["tp_comm_hidden"] == 0.0
    hidden = on.time["tp_comm_hidden"]
    everything = on.time["tp_comm"] + hidden
    # the ring sends the same bytes (one latency per piece more): within 1% of the collectives'
    assert everything == pytest.approx(off.time["tp_comm"], rel=0.01)
    # 512 positions per rank: 4 pieces per chunk; the first of the 8 x 4 always waits
    assert 0.5 * everything < hidden < everything * (1 - 1 / 32)
    assert on.step_time_s == pytest.approx(off.step_time_s - off.time["tp_comm"] + on.time["tp_comm"])
    # bounded by the GEMMs: a collective far slower than its GEMM hides only the GEMM's time
    g = [x / 1e15 for x in time_terms.block_gemm_flops(SHAPE, 4096, 8)]
    slow = time_terms.tp_overlap_hidden(SHAPE, lay.replace(async_tp=True), 4096, 1.0, 1e15, 1, 4)
    assert slow == pytest.approx(3 * sum(g) * (1 - 1 / 32))
    one_piece = time_terms.tp_overlap_hidden(SHAPE, lay.replace(async_tp=True), 4096, 1.0, 1e15, 1)
    assert one_piece == pytest.approx(3 * sum(g) * 7 / 8)
    assert (
        time_terms.tp_overlap_hidden(SHAPE, lay.replace(async_tp=True, sequence_parallel=False), 4096, 1.0, 1e15, 1)
        == 0
    )


def test_async_tp_takes_the_head_into_its_ring_when_the_logits_are_whole():
    """With train.loss_chunk_size = 0 the head's input all-gather runs in the ring beside the
    vocab-sharded head GEMM (parallel/tensor/async_tp.py AllGatherMatmulHead); the chunked loss
    gathers with DTensor's collective, so nothing more hides there."""
    from dataclasses import replace

    lay = plan_layout(8, 1, 1, micro_batch_size=1, num_microbatches=1, async_tp=True)
    chunked, whole = H100, replace(H100, loss_chunk_size=0)
    a, b = estimate(SHAPE, lay, 4096, 8, "bf16", chunked, 8), estimate(SHAPE, lay, 4096, 8, "bf16", whole, 8)
    head_gemm = 2 * 4096 * SHAPE.hidden * SHAPE.vocab_size / 8
    extra = b.time["tp_comm_hidden"] - a.time["tp_comm_hidden"]
    assert 0 < extra  # the head's collective, beside a GEMM 4x the MLP's input one: hidden all but its first piece
    per = time_terms.tp_overlap_hidden(SHAPE, lay, 4096, 1.0, 1e15, 1, 4, head=True)
    assert per - time_terms.tp_overlap_hidden(SHAPE, lay, 4096, 1.0, 1e15, 1, 4) == pytest.approx(
        3 * head_gemm / 1e15 * (1 - 1 / 32)
    )
    # a pipeline stage holds one end only: not priced as a ring there
    pp = lay.replace(pp=2, num_microbatches=4)
    assert estimate(SHAPE, pp, 4096, 8, "bf16", whole, 8).time["tp_comm_hidden"] == pytest.approx(
        estimate(SHAPE, pp, 4096, 8, "bf16", chunked, 8).time["tp_comm_hidden"]
    )


def test_last_stage_pays_for_the_output_head():
    # 32 blocks over 16 stages: 2 blocks + the 128K-vocab head on the last stage
    lay = plan_layout(1, 16, 1, num_microbatches=16)
    k = time_terms.stage_imbalance(SHAPE, lay, 4096, 2)
    block = (SHAPE.hardware_flops_per_token(4096, "none") - 6 * SHAPE.vocab_size * SHAPE.hidden) / 32
    want = (2 * block + 6 * SHAPE.vocab_size * SHAPE.hidden) * 16 / SHAPE.hardware_flops_per_token(4096, "none")
    assert k == pytest.approx(want) and k > 1.05
    assert time_terms.stage_imbalance(SHAPE, plan_layout(1, 1, 1), 4096, 32) == 1.0


def test_interleaving_only_where_megatron_runs_it():
    """pp > 2, and every chunk count v that divides the blocks per stage (Megatron's argument
    check), or with the embedding and the loss counted as a block each (first/last chunk one block
    fewer); before, only v = 2 and 4 were tried, so 3 blocks per stage (the published 529.6B
    layout, 105 blocks over pp 35) found no interleaving at all and the search was refused."""
    f = open_layout()

    def interleaved(pp, layers):
        return [(v, split) for s, v, split in _schedules(pp, f, layers) if s == "interleaved_1f1b"]

    assert not interleaved(2, 32)  # Megatron: pp > 2
    assert [v for v, _ in interleaved(4, 24)] == [2, 3, 6]  # 6 blocks per stage
    assert interleaved(35, 105) == [(3, ())] and [v for v, _ in interleaved(4, 60)] == [3, 5, 15]
    llama3 = interleaved(16, 126)  # 8 blocks per stage (the last stage 6), and 128 = 126 + 2 in 16 x v chunks
    assert [v for v, split in llama3 if not split] == [2, 4, 8]
    assert (8, (0,) + (1,) * 126 + (0,)) in llama3 and (2, (3,) + (4,) * 30 + (3,)) in llama3
    assert [
        (v, split) for s, v, split in _schedules(4, open_layout(pp_layers=(1,) * 8), 8) if s == "interleaved_1f1b"
    ] == [(2, (1,) * 8)]  # a given split implies its chunk count


def test_async_tp_runs_on_any_backend_but_needs_sequence_parallelism():
    """The decomposed ring runs on gloo too (parallel/tensor/async_tp.py): no device refusal;
    it overlaps sequence parallelism's collectives, so without SP it is refused."""
    lay = plan_layout(2, 1, 1, micro_batch_size=1, async_tp=True)
    shape = from_preset("debug")
    rules.check(lay, shape, Batch(128, 1, 2, "cpu"))
    rules.check(lay, shape, Batch(128, 1, 2, "cuda"))
    no_sp = plan_layout(2, 1, 1, micro_batch_size=1, async_tp=True, sequence_parallel=False)
    with pytest.raises(ConfigError, match="parallel.async_tp"):
        rules.check(no_sp, shape, Batch(128, 1, 2, "cpu"))


def test_zero1_waits_for_its_parameter_all_gather_whole():
    """The all-gather after the optimizer step has nothing to run beside (issue 42): exposed
    whole, beside the reduce-scatter's last bucket; fp32 ZeRO-1 (ZeroRedundancyOptimizer) pays
    DDP's all-reduce and then its broadcasts (priced as the all-gather they amount to)."""
    psi = stage_params(SHAPE, 1, 1)[0]
    lay = plan_layout(1, 1, 8, zero_stage=1)
    after = collective_time(H100, "all_gather", 2 * psi, 1, 8, 8)
    assert dp_after_step(SHAPE, lay, "bf16", H100, 8) == pytest.approx(after)
    dp_s = dp_time(SHAPE, lay, "bf16", H100, 8)
    rs = dp_s - after
    last = last_reduction_share(SHAPE, lay, "bf16")  # one bucket of 25 MiB of bf16 gradients
    assert last == pytest.approx(25 * 2**20 / (2 * psi))
    hidden = rs * (1 - last) * H100.comm_overlap  # a long backward: all but the last bucket hides
    want = dp_s - hidden + hidden * H100.comm_interference
    assert dp_exposed(dp_s, 1e6, SHAPE, lay, H100, 1.0, after, "bf16") == pytest.approx(want)
    assert dp_exposed(dp_s, 1e6, SHAPE, lay, H100, 1.0, after, "bf16") > after + rs * last
    # one bucket as large as the model: reduced after backward, nothing hides
    whole = lay.replace(ddp_bucket_mb=65536)
    assert dp_exposed(dp_s, 1e6, SHAPE, whole, H100, 1.0, after, "bf16") == pytest.approx(dp_s)
    # FSDP reduces per block (32); torch DDP's first bucket is 1 MiB, then 25 MiB ones
    assert last_reduction_share(SHAPE, lay.replace(zero_stage=3), "bf16") == 1 / 32
    assert last_reduction_share(SHAPE, lay.replace(zero_stage=0), "bf16") == pytest.approx(25 * 2**20 / (4 * psi))
    tiny = from_preset("debug")  # 0.9M parameters: 3.6 MB of fp32 gradients, 1 MiB first
    share = last_reduction_share(tiny, plan_layout(1, 1, 2, zero_stage=0), "fp32")
    assert share == pytest.approx(1 - 2**20 / (4 * stage_params(tiny, 1, 1)[0]))
    est = estimate(SHAPE, lay, 4096, 8, "bf16", H100, 8)
    assert est.time["dp_comm_exposed"] > after
    ar = collective_time(H100, "all_reduce", 4 * psi, 1, 8, 8)
    assert dp_time(SHAPE, lay, "fp32", H100, 8) == pytest.approx(
        ar + collective_time(H100, "all_gather", 4 * psi, 1, 8, 8)
    )
    assert dp_after_step(SHAPE, lay.replace(zero_stage=2), "bf16", H100, 8) == 0.0


def test_pipeline_transfers_wait_once_per_exchange_beside_the_bubble():
    """1F1B fires a steady-state send with the receive it needs next (full duplex: one transfer's
    time per exchange), m*v exchanges plus p - 1 in the fill and drain (issue 42); the step adds
    them once, outside the bubble's idle compute."""
    lay = plan_layout(1, 4, 1, micro_batch_size=1, num_microbatches=8)
    act = 4096 * SHAPE.hidden * 2
    one = collective_time(H100, "send_recv", act, 1, 4, 8)
    assert pp_time(SHAPE, lay, 4096, "bf16", H100, 8) == pytest.approx((8 + 3) * one)
    est = estimate(SHAPE, lay, 4096, 8, "bf16", H100, 8)
    t = est.time
    parts = ("gemm", "non_gemm", "tp_comm", "cp_comm", "pp_p2p", "ep_a2a", "bubble", "dp_comm_exposed", "optimizer")
    assert est.step_time_s == pytest.approx(sum(t[k] for k in parts))
    busy = t["gemm"] + t["non_gemm"]
    assert t["bubble"] == pytest.approx(busy * 3 / 8)  # (p - 1) / m of the compute, none of the transfers
