"""The planner's memory model against published measurements (issue 28): one H100's peaks, the
Llama 3 405B 8K layout as the paper ran it, the ZeRO paper's Table 1, and fixed layouts
answered as asked."""

import pytest

from meshforge.planner.estimate import plan_layout
from meshforge.planner.hardware import get_hardware
from meshforge.planner.memory import allocated_gib, memory
from meshforge.planner.model_flags import from_preset
from meshforge.planner.plan import parse_plan_args, plan_from_args

H100 = get_hardware("h100-sxm")
GB = 1e9

# One H100, bf16, meshforge's single-device path (autocast over fp32 weights, AdamW), 2026-11-24
# (issues 27 and 28). The runs predate the chunked loss: loss_chunk_size = 0 (full fp32 logits).
# Issue 28 gives predicted/measured ratios against the planner of then (41.0 GiB for the 1B rows,
# 61.0 for 3B): measured = that prediction / ratio. Issue 27 gives the no-accumulation peaks.
# (name, preset, seq, micro-batch, micro-batches per step, recompute, compiled, measured GiB)
H100_PEAKS = [
    ("1B 4K eager, 16 x mb 2", "llama3.2-1b", 4096, 2, 8, "none", False, 41.0 / 0.81),
    ("1B 4K compiled, 16 x mb 2", "llama3.2-1b", 4096, 2, 8, "none", True, 41.0 / 0.92),
    ("1B 8K eager, 8 x mb 1", "llama3.2-1b", 8192, 1, 8, "none", False, 41.0 / 0.81),
    ("1B 8K compiled, 8 x mb 1", "llama3.2-1b", 8192, 1, 8, "none", True, 41.0 / 0.92),
    ("3B 4K compiled full AC, 16 x mb 2", "llama3.2-3b", 4096, 2, 8, "full", True, 61.02 / 0.94),
    ("1B 16K compiled, batch 1", "llama3.2-1b", 16384, 1, 1, "none", True, 63.4),
    ("1B 4K eager, batch 2", "llama3.2-1b", 4096, 2, 1, "none", False, 45.8),
    ("1B 4K compiled, batch 2", "llama3.2-1b", 4096, 2, 1, "none", True, 39.8),
]


@pytest.mark.parametrize("row", H100_PEAKS, ids=[r[0] for r in H100_PEAKS])
def test_h100_peak_memory_within_5_percent(row):
    """torch.cuda.max_memory_allocated (meshforge's peak_mem_gib) against the model's allocated
    part (the total less the context/fragmentation reserve), within 0.95-1.05."""
    _, preset, seq, mb, m, ac, compiled, measured = row
    lay = plan_layout(1, 1, 1, micro_batch_size=mb, num_microbatches=m, activation_checkpoint=ac)
    mem = memory(from_preset(preset), lay, seq, "bf16", H100, compiled=compiled, loss_chunk_size=0)
    assert 0.95 <= allocated_gib(mem) / measured <= 1.05, mem


def test_chunked_loss_removes_the_full_logits():
    """With train.loss_chunk_size = 1024 a 1B run at 32K holds one chunk's logits, not 32K rows'."""
    lay = plan_layout(1, 1, 1, micro_batch_size=1, num_microbatches=1, activation_checkpoint="full")
    full = memory(from_preset("llama3.2-1b"), lay, 32768, "bf16", H100, loss_chunk_size=0)
    chunked = memory(from_preset("llama3.2-1b"), lay, 32768, "bf16", H100, loss_chunk_size=1024)
    assert full["working"] > 50 and chunked["working"] < full["working"] / 10  # the whole loss: its backward peaks
    assert chunked["total"] < full["total"] - 50


def test_llama3_405b_8k_fits_without_recompute_as_published():
    """Llama 3 paper, Table 4 and section 3.3: 8,192 H100s, tp 8 (with SP), cp 1, pp 16, dp 64,
    micro-batch 1 of 8K tokens, 32 micro-batches per step, interleaved 1F1B with one block per
    virtual stage (the first chunk only the embedding, the last only the head), FSDP sharding
    optimizer state and gradients (ZeRO-2), no activation checkpointing."""
    split = (0,) + (1,) * 126 + (0,)
    lay = plan_layout(8, 16, 64, zero_stage=2, micro_batch_size=1, num_microbatches=32)
    lay = lay.replace(pp_schedule="interleaved_1f1b", pp_virtual_stages=8, pp_layers=split)
    mem = memory(from_preset("llama3.1-405b"), lay, 8192, "bf16", H100)
    assert mem["total"] < H100.hbm_gib, mem
    assert mem["activations"] > 40  # 112 blocks x 8K tokens held by the first rank: most of the GPU


# ZeRO paper (Rajbhandari et al. 2019), Table 1: 7.5B parameters, Nd = 64, K = 12, in GB
ZERO_TABLE1 = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}


def _plan(argv: list[str]):
    return plan_from_args(parse_plan_args([*argv, "--gpus-per-node", "8", "--json"]))


SHAPE_7B5 = ["--layers", "36", "--hidden", "4096", "--heads", "32", "--vocab", "51200", "--mlp", "gelu"]
SHAPE_7B5 += ["--attention", "flash"]


@pytest.mark.parametrize("zero", sorted(ZERO_TABLE1))
def test_zero_paper_table1_model_states(zero):
    """Ψ(2+2+K) for DDP, 2Ψ+2Ψ+KΨ/Nd for stage 1, 2Ψ+(2+K)Ψ/Nd for stage 2 (FSDP2: the
    parameters gathered from forward to backward are its 2Ψ), (2+2+K)Ψ/Nd for stage 3: the
    layout fixed as asked (dp inferred: 64), overflowing or not, within 3%."""
    pl = _plan([*SHAPE_7B5, "--gpus", "64", "--tp", "1", "--pp", "1", "--zero", str(zero), "--gpu", "h100-sxm"])
    e = pl.results[0]
    assert (e.layout.dp, e.layout.zero_stage, e.layout.offload) == (64, zero, "none")
    m = e.memory
    gathered = m["buffers"] - 2 * 25 * 2**20 / 2**30 if zero == 2 else 0.0  # stage 3: per-block buffers
    states_gb = (m["params"] + m["grads"] + m["optimizer"] + gathered) * 2**30 / GB
    scaled = ZERO_TABLE1[zero] * pl.shape.num_params() / 7.5e9  # the table is for exactly 7.5B
    assert states_gb == pytest.approx(scaled, rel=0.03)
    assert e.fits == (zero > 0) and pl.results.fits_nothing == (zero == 0)  # DDP's 120 GB: shown, overflowing


def test_fixed_layout_without_dp_is_answered_not_searched():
    """--tp 1 --pp 1 --gpus 64 --zero 1 without --dp: dp is determined (64), the layout is fixed and
    its overflow shown (before: treated as an open search that "fits nothing")."""
    pl = _plan(["--model", "llama3.1-70b", "--gpus", "64", "--tp", "1", "--pp", "1", "--zero", "1"])
    assert pl.results.fits_nothing and all(e.layout.dp == 64 and e.layout.zero_stage == 1 for e in pl.results)
    assert all(e.layout.offload == "none" for e in pl.results)


def test_fixed_layout_is_not_swapped_for_an_offloaded_one():
    """With --dp the default offload mode used to swap in a CPU-offloaded variant of an
    overflowing layout; a fixed layout is answered as asked, offloaded only with --offload cpu."""
    argv = ["--model", "llama3.1-70b", "--gpus", "8", "--tp", "1", "--pp", "1", "--dp", "8", "--zero", "3"]
    argv += ["--seq-len", "8192", "--global-batch", "8", "--micro-batch", "1", "--recompute", "none"]
    asked = _plan(argv)
    assert asked.results.fits_nothing and {e.layout.offload for e in asked.results} == {"none"}
    offloaded = _plan([*argv, "--offload", "cpu"])
    assert {e.layout.offload for e in offloaded.results} == {"cpu"}


@pytest.mark.parametrize("compile_,chunk,mixed", [(False, 0, "autocast"), (True, 0, "auto"), (False, 512, "cast_once")])
def test_plan_from_config_prices_the_runs_compile_and_loss_chunk(tmp_path, compile_, chunk, mixed):
    """`meshforge plan --config` describes the run's own memory: train.compile (an eager block
    keeps fp32 norm outputs), train.loss_chunk_size (0: the full logits) and train.mixed_precision
    (auto: cast once on a GPU) reach the memory model, as the H100 calibration rows above pass them by hand."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[model]\npreset = "llama3.2-1b"\n[train]\nseq_len = 4096\nglobal_batch_size = 2\nmicro_batch_size = 2\n'
        f'precision = "bf16"\nactivation_checkpoint = "none"\ncompile = {str(compile_).lower()}\n'
        f'loss_chunk_size = {chunk}\nmixed_precision = "{mixed}"\n'
    )
    argv = ["--config", str(cfg), "--gpus", "1", "--gpu", "h100-sxm", "--tp", "1", "--pp", "1", "--zero", "0"]
    e = plan_from_args(parse_plan_args(argv)).results[0]
    resolved = "cast_once" if mixed == "auto" else mixed
    shape = from_preset("llama3.2-1b")
    want = memory(shape, e.layout, 4096, "bf16", H100, compiled=compile_, loss_chunk_size=chunk, mixed=resolved)
    assert e.memory == pytest.approx(want)
    default = memory(shape, e.layout, 4096, "bf16", H100, mixed=resolved)  # compiled, 1024-row chunks
    assert e.memory["total"] > default["total"]  # each of these runs holds more than the default
    other = "autocast" if resolved == "cast_once" else "cast_once"
    assert memory(shape, e.layout, 4096, "bf16", H100, compiled=compile_, loss_chunk_size=chunk, mixed=other) != want
