"""Memory per GPU of one layout, as an explained breakdown (the model is described in
planner/estimate.py's docstring): model states by ZeRO stage, activations by recomputation
and pipeline schedule, buffers, and what overflows."""

from __future__ import annotations

from meshforge.layout import Layout
from meshforge.models.chunked_loss import DEFAULT_CHUNK
from meshforge.models.shape import ModelShape
from meshforge.parallel.context_parallel_cost import (
    local_tokens,
    ring_extra_saved_bytes_per_token,
)
from meshforge.planner import moe_costs, offload_costs
from meshforge.planner.hardware import GIB, Hardware
from meshforge.planner.zero1_partition import largest_share


def model_state_bytes(psi: float, n: int, stage: int, precision: str) -> dict[str, float]:
    """ZeRO paper: bytes of parameters, gradients and optimizer state per GPU."""
    p, g, k = (2.0, 2.0, 12.0) if precision in ("bf16", "fp8") else (4.0, 4.0, 8.0)
    return {
        "params": psi * p / (n if stage >= 3 else 1),
        "grads": psi * g / (n if stage >= 2 else 1),
        "optimizer": psi * k / (n if stage >= 1 else 1),
    }


def allocated_state_bytes(shape: ModelShape, lay: Layout, psi: float, precision: str) -> dict[str, float]:
    """What meshforge allocates for parameters, gradients and optimizer state on the most
    loaded GPU (held equal to a run's ``state_mem_bytes`` by tests/test_planner_memory.py).
    ZeRO-2/3 are FSDP2, which keeps fp32 shards of parameters and gradients (the sharded
    parameter is the fp32 master; bf16 working copies are gathered per unit and counted under
    buffers): 4Ψ/N + 4Ψ/N + 8Ψ/N in either precision — the ZeRO paper's 16Ψ/N for stage 3,
    and stage 2 without its replicated 2Ψ (FSDP2 holds it gathered only from forward to
    backward). DDP and ZeRO-1 follow the paper. fp32 ZeRO-1 (``ZeroRedundancyOptimizer``)
    splits its optimizer state by whole parameters (zero1_partition.py), so its most loaded
    rank holds more than 1/N; bf16/fp8 ZeRO-1 (parallel/zero1.py) splits flat buffers evenly."""
    n = lay.dp * lay.cp
    if lay.zero_stage >= 2 and (n > 1 or lay.offload == "cpu"):  # FSDP2 (a world of one: when offloading)
        return {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer": 8 * psi / n}
    states = model_state_bytes(psi, n, lay.zero_stage, precision)
    if lay.zero_stage == 1 and n > 1 and precision not in ("bf16", "fp8"):
        states["optimizer"] *= n * largest_share(shape, lay.tp, lay.pp, n)
    return states


def activation_bytes_per_layer(
    shape: ModelShape, seq: int, micro: int, tp: int, sp: bool, recompute: str, bytes_per: int = 2
) -> float:
    """Activation bytes one layer keeps for backward for one micro-batch (see module doc)."""
    s, b, h, a = seq, micro, shape.hidden, shape.heads
    if shape.mlp == "gelu":  # Korthikanti et al. 2022, Table 2 (bf16, with dropout)
        if recompute == "full":
            return 2 * s * b * h / (tp if sp else 1)
        attn_sq = 0.0 if recompute == "selective" or shape.attention == "flash" else 5 * a * s * s * b / tp
        if sp:
            return s * b * h * 34 / tp + attn_sq
        return s * b * h * (10 + 24 / tp) + attn_sq
    kv, f = shape.kv_dim, shape.ffn_hidden
    if recompute == "full":
        return s * b * h * bytes_per / (tp if sp else 1)
    if recompute == "selective":
        sharded, whole = (2 * kv + 2 * f + 2 * h), 2 * h  # matmul outputs; residual-stream inputs
    else:
        sharded, whole = (h + 2 * kv + 4 * f), 4 * h  # + norm outputs, activation and product
    # sharded parts split over tp (heads/columns); the residual-stream parts only under SP
    return s * b * bytes_per * (sharded / tp + whole / (tp if sp else 1))


def in_flight(schedule: str, p: int, m: int, v: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (in stage units)."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        return p * (1 + (p - 1) / (p * v))
    return float(min(m, p))


def stage_layers(shape: ModelShape, pp: int) -> int:
    """Blocks on the most loaded stage (stages may be uneven: the first ceil(L/p))."""
    return -(-shape.layers // pp)


def stage_params(shape: ModelShape, tp: int, pp: int) -> tuple[float, float]:
    """Parameters on the most loaded stage's GPU, and the per-layer parameters on it."""
    per_layer = shape.block_params() / tp
    layers = stage_layers(shape, pp)
    first = layers * per_layer + shape.embedding_params() / tp
    last = layers * per_layer + (shape.head_params() + shape.hidden) / tp
    if pp == 1:
        return layers * per_layer + (shape.embedding_params() + shape.head_params() + shape.hidden) / tp, per_layer
    return max(first, last), per_layer


def stage_state_bytes(shape: ModelShape, lay: Layout, precision: str) -> dict[str, float]:
    """Parameters, gradients and optimizer state the most loaded GPU's rank allocates (experts included)."""
    psi, _ = stage_params(shape, lay.tp, lay.pp)
    psi_e = moe_costs.expert_params_on_stage(shape, lay.tp, lay.pp)  # 0 for a dense model
    states = allocated_state_bytes(shape, lay, psi - psi_e, precision)
    experts = moe_costs.expert_state_bytes(
        shape, lay, psi_e, precision, lambda p: allocated_state_bytes(shape, lay, p, precision)
    )
    return {k: v + experts[k] for k, v in states.items()}


def memory(
    shape: ModelShape, lay: Layout, seq: int, precision: str, hw: Hardware, loss_chunk: int = DEFAULT_CHUNK
) -> dict[str, float]:
    """Device memory per GPU by part (GiB, see the module doc); under CPU offload the model
    states are on the host (``offload_costs``) and only their staging copies stay here.
    ``loss_chunk`` (train.loss_chunk_size): the loss's logits exist for that many tokens at a
    time, plus an fp32 head-gradient accumulator; 0: for all of the micro-batch's tokens."""
    psi, per_layer = stage_params(shape, lay.tp, lay.pp)
    psi_e = moe_costs.expert_params_on_stage(shape, lay.tp, lay.pp)  # 0 for a dense model
    states = stage_state_bytes(shape, lay, precision)
    offloaded = lay.offload == "cpu"
    if offloaded:
        states = {k: 0.0 for k in states}
    bpe = 4 if precision == "fp32" else 2
    act_layer = activation_bytes_per_layer(
        shape,
        local_tokens(seq, lay.cp),
        lay.micro_batch_size,
        lay.tp,
        lay.sequence_parallel,
        lay.activation_checkpoint,
        bpe,
    )
    if lay.cp > 1 and lay.activation_checkpoint != "full":  # ring attention's lse (and fp32 output under bf16)
        extra = ring_extra_saved_bytes_per_token(shape.heads / lay.tp, shape.head_dim, bpe)
        act_layer += lay.micro_batch_size * local_tokens(seq, lay.cp) * extra
    layers_per_stage = stage_layers(shape, lay.pp)
    act_layer += (
        moe_costs.moe_layers_on_stage(shape, lay.pp)
        / layers_per_stage
        * moe_costs.activation_delta_bytes(
            shape, lay.micro_batch_size * local_tokens(seq, lay.cp), lay.tp, lay.activation_checkpoint, bpe
        )
    )
    acts = (
        act_layer * layers_per_stage * in_flight(lay.pp_schedule, lay.pp, lay.num_microbatches, lay.pp_virtual_stages)
    )
    tokens = lay.micro_batch_size * seq // lay.cp
    chunk = min(tokens, loss_chunk or tokens)  # chunked loss: one chunk's logits + an fp32 head-gradient accumulator
    logits = chunk * shape.vocab_size / lay.tp * (bpe + 4 + 4)  # logits, fp32 copy, its gradient
    logits += (chunk < tokens) * shape.vocab_size * shape.hidden / lay.tp * 4
    acts += logits
    w = 2 if precision != "fp32" else 4
    fsdp = lay.dp > 1 or lay.offload == "cpu"  # (a world of one offloads on a one-rank FSDP2 mesh)
    if lay.zero_stage == 2 and fsdp:
        gathered = psi * w  # parameters kept gathered from forward to backward
    elif lay.zero_stage == 3 and fsdp:
        gathered = 2 * per_layer * w  # the running block and the prefetched one
    else:
        gathered = 0.0
    gathered += moe_costs.gathered_delta_bytes(shape, lay, psi_e, w) if lay.dp > 1 else 0.0
    buffers = 2 * 25 * 2**20 + gathered
    if offloaded:
        buffers += offload_costs.staging_bytes(per_layer, lay.dp * lay.cp)
    out = {
        "params": states["params"] / GIB,
        "grads": states["grads"] / GIB,
        "optimizer": states["optimizer"] / GIB,
        "activations": acts / GIB,
        "buffers": buffers / GIB,
        "reserve": hw.reserve_gib,
    }
    out["total"] = sum(out.values())
    return out


def overflow_reason(mem: dict[str, float], hbm_gib: float) -> str:
    """What overflows: the total against the GPU, the largest parts, and whether the model
    states or the activations alone exceed it (so the fix is more sharding or recomputation)."""
    over = mem["total"] - hbm_gib
    parts = sorted((k for k in mem if k != "total"), key=lambda k: -mem[k])[:3]
    msg = f"needs {mem['total']:.1f} GiB of {hbm_gib:.0f} GiB ({over:.1f} over); largest: " + ", ".join(
        f"{k} {mem[k]:.1f}" for k in parts
    )
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    if states > hbm_gib:
        msg += f"; the model states alone ({states:.1f} GiB) exceed the GPU: shard them (higher zero, tp, pp)"
    elif mem["activations"] > hbm_gib - states:
        msg += "; the activations exceed what the model states leave: recompute, smaller micro-batch, or more tp/cp"
    return msg
