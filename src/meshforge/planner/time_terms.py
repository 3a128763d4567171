"""Step-time terms that depend on where work sits, not on how much there is: the slowest
pipeline stage (blocks plus the output head or the embedding), and the tensor-parallel
collectives that tp-communication overlap (Megatron-Core ``--tp-comm-overlap``, torchtitan's
async TP; ``parallel.async_tp``) hides behind the GEMMs beside them. Bytes and FLOPs only:
nothing here is fitted to a run."""

from __future__ import annotations

from meshforge.config.layout import Layout
from meshforge.models import flops
from meshforge.models.shape import ModelShape


def stage_imbalance(shape: ModelShape, lay: Layout, seq: int, slowest_blocks: float) -> float:
    """The slowest pipeline stage's work over the mean stage's (1 without pipelining).

    Megatron (and meshforge without ``parallel.pp_layers``) splits stages evenly by blocks,
    so the last stage also runs the output head (6·vocab·hidden FLOPs per token, forward and
    backward) and the first the embedding (a lookup: no FLOPs); at 2-3 blocks per stage the
    head is 7-8% of the last stage's work. ``slowest_blocks``: the blocks on the most
    loaded stage (ceil(L/p), or the largest of ``pp_layers``' per-stage sums)."""
    if lay.pp <= 1:
        return 1.0
    total = shape.hardware_flops_per_token(seq, lay.activation_checkpoint)
    head = flops.head_flops_per_token(shape)
    block = (total - head) / shape.layers
    last = _last_stage_blocks(lay, slowest_blocks)
    slowest = max(slowest_blocks * block, last * block + head)
    return slowest * lay.pp / total


def _last_stage_blocks(lay: Layout, slowest_blocks: float) -> float:
    """Blocks on the last pipeline rank (which holds the head): its chunks under ``pp_layers``."""
    if not lay.pp_layers:
        return slowest_blocks
    return float(sum(lay.pp_layers[lay.pp - 1 :: lay.pp]))


def block_gemm_flops(shape: ModelShape, tokens: float, tp: int) -> tuple[float, ...]:
    """One block's forward GEMMs on one tp rank, in the order of the tp collectives beside them
    under sequence parallelism: the q/k/v projection after the attention input's all-gather,
    the output projection before its reduce-scatter, the MLP's input GEMM(s) after the MLP
    input's all-gather, the MLP's output GEMM before its reduce-scatter."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_hidden
    mlp_in = 2 * f if shape.mlp == "swiglu" else f
    return tuple(2.0 * tokens * h * n / tp for n in (h + 2 * kv, h, mlp_in, f))


def tp_overlap_hidden(
    shape: ModelShape,
    lay: Layout,
    tokens_mb: float,
    per_collective_s: float,
    gemm_rate: float,
    blocks: float,
    pieces: int = 1,
    head: bool = False,
) -> float:
    """Seconds of tp communication a step hides under chunked GEMMs (async TP).

    Each all-gather / reduce-scatter of a block (``per_collective_s``) is split into tp
    chunks of ``pieces`` pieces each, each piece's transfer beside the GEMM on the piece before
    it: the first piece's transfer waits, the rest hides as far as the neighbouring GEMM lasts,
    i.e. per collective min(c, g)·(1 - 1/(tp·pieces)) for a GEMM of g seconds (forward g,
    backward 2g, the recomputed forward g again under full recomputation). Only under sequence
    parallelism (the all-gather / reduce-scatter form both implementations need). ``head``: the
    head's input all-gather also runs as a ring, beside the vocab-sharded head GEMM (forward, and
    its input gradient's reduce-scatter in backward), once per micro-batch."""
    if not lay.async_tp or lay.tp <= 1 or not lay.sequence_parallel:
        return 0.0
    g = [x / gemm_rate for x in block_gemm_flops(shape, tokens_mb, lay.tp)]
    fwd = sum(min(per_collective_s, x) for x in g)
    bwd = sum(min(per_collective_s, 2 * x) for x in g)
    passes = fwd * (2 if lay.activation_checkpoint == "full" else 1) + bwd
    g_head = 2.0 * tokens_mb * shape.hidden * shape.vocab_size / lay.tp / gemm_rate if head else 0.0
    ends = min(per_collective_s, g_head) + min(per_collective_s, 2 * g_head) if head else 0.0
    return lay.num_microbatches * (blocks * passes + ends) * (1 - 1 / (lay.tp * pieces))
