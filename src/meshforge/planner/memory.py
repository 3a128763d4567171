"""Memory per GPU of one layout, as an explained breakdown: model states by ZeRO stage (the
ZeRO paper, as meshforge allocates them), activations by recomputation and pipeline schedule
(Korthikanti et al. 2022, counted per saved tensor for a Llama block), the loss's logits,
autocast's weight copies, buffers and a reserve; docs/planner.md derives each part and
calibrates them on one H100. ``memory()`` assumes compiled blocks (fused element-wise work, as
Megatron/TE runs and ``train.compile``) and the chunked loss unless told otherwise."""

from __future__ import annotations

from meshforge.config.layout import Layout
from meshforge.models.shape import LOSS_CHUNK_SIZE, ModelShape
from meshforge.parallel.rules import casts_once
from meshforge.planner import moe_costs, offload_costs, peak_bytes
from meshforge.planner.activation_bytes import (
    TOKEN_ID_BYTES,
    Holding,
    block_bytes_per_token,
    ends_bytes_per_token,
    holding,
    loss_saved_bytes_per_token,
    rope_bytes_per_token,
)
from meshforge.planner.context_costs import (
    local_tokens,
    ring_extra_saved_bytes_per_token,
)
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
    loaded GPU (held equal to a run's ``state_mem_bytes`` per part by tests/integration/test_planner_memory_vs_runs.py).
    meshforge keeps fp32 weights and gradients in every precision (bf16 comes from autocast, or
    from FSDP2's cast of the gathered weights, counted under buffers) except bf16/fp8 ZeRO-1
    (parallel/data/zero1.py: bf16 working weights and gradients, the fp32 master and Adam's moments
    split evenly: the ZeRO paper's 2Ψ + 2Ψ + 12Ψ/N). ZeRO-2/3 are FSDP2's fp32 shards, 4Ψ/N +
    4Ψ/N + 8Ψ/N; DDP (and a world of one) 4Ψ + 4Ψ + 8Ψ; fp32 ZeRO-1 (``ZeroRedundancyOptimizer``)
    splits its optimizer state by whole parameters (zero1_partition.py), so its most loaded rank
    holds more than 1/N."""
    n = lay.dp * lay.cp
    if lay.zero_stage >= 2 and (n > 1 or lay.offload == "cpu"):  # FSDP2 (a world of one: when offloading)
        return {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer": 8 * psi / n}
    if lay.zero_stage == 1 and n > 1:
        if precision in ("bf16", "fp8"):
            return model_state_bytes(psi, n, 1, "bf16")
        return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi * largest_share(shape, lay.tp, lay.pp, n)}
    return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}


def on_fsdp(lay: Layout, precision: str, mixed: str = "autocast") -> bool:
    """The layout runs on FSDP2: ``Layout.uses_fsdp``, or ``dims.casts_once`` (bf16 cast once on
    a world of one or DDP's layouts, a world of one offloading)."""
    return lay.uses_fsdp() or casts_once(lay, precision, mixed)


def autocast_layout(lay: Layout, precision: str, mixed: str = "autocast") -> bool:
    """Mixed precision by autocast over fp32 weights (one device, DDP, ZeRO-1, tp without FSDP,
    unless cast once): the residual stream stays fp32 and the bf16 casts of the weights are saved
    for backward. On FSDP2 the weights are gathered in bf16 and the whole block runs in bf16."""
    return precision in ("bf16", "fp8") and not on_fsdp(lay, precision, mixed)


def activation_bytes_per_layer(
    shape: ModelShape,
    seq: int,
    micro: int,
    tp: int,
    sp: bool,
    recompute: str,
    bytes_per: int = 2,
    resid_bytes: int | None = None,
    eager: bool = False,
    unit_cast: bool = False,
) -> float:
    """Activation bytes one layer keeps for backward for one micro-batch (see module doc)."""
    s, b, h, a = seq, micro, shape.hidden, shape.heads
    rb = bytes_per if resid_bytes is None else resid_bytes
    if shape.mlp == "gelu":  # Korthikanti et al. 2022, Table 2 (bf16, with dropout)
        if recompute == "full":
            return 2 * s * b * h / (tp if sp else 1)
        attn_sq = 0.0 if recompute == "selective" or shape.attention == "flash" else 5 * a * s * s * b / tp
        if sp:
            return s * b * h * 34 / tp + attn_sq
        return s * b * h * (10 + 24 / tp) + attn_sq
    hold = Holding(bytes_per, rb, rb > bytes_per, unit_cast)
    return s * b * block_bytes_per_token(shape, hold, recompute, eager, tp, sp)


def loss_bytes(tokens: float, vocab_local: float, precision: str, chunk: int) -> float:
    """The loss's peak in its backward: logits in the compute dtype (held by the caller), the fp32
    log-softmax output cross-entropy saves, its gradient and the logits' fp32 gradient — 14 bytes
    per logit in bf16, 16 in fp32. A chunked loss (``train.loss_chunk_size``) holds one chunk's."""
    per = 16 if precision == "fp32" else 14
    rows = min(tokens, chunk) if chunk > 0 else tokens
    return rows * vocab_local * per


def in_flight(schedule: str, p: int, m: int, v: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (in stage units)."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        return p * (1 + (p - 1) / (p * v))
    return float(min(m, p))


def held_layers(shape: ModelShape, lay: Layout) -> float:
    """Layer-micro-batches whose activations the first pipeline rank holds at its peak. Given a
    split (``pp_layers``, per chunk in pipeline order) under interleaved 1F1B, counted forward by
    forward: Megatron's first rank runs 2(p-1) + (v-1)p + 1 chunk-forwards before its first
    backward, p micro-batches per chunk, cycling over its chunks p, 2p, ... apart (Llama 3 gives
    the first and last chunk no block, only the embedding or the head). Else the in-flight
    micro-batches times the blocks on the most loaded stage."""
    p, v, m = lay.pp, lay.pp_virtual_stages, lay.num_microbatches
    if lay.pp_schedule == "interleaved_1f1b" and len(lay.pp_layers) == p * v and p > 1:
        mine = [lay.pp_layers[j * p] for j in range(v)]  # the first rank's chunks
        warm = min(m * v, 2 * (p - 1) + (v - 1) * p + 1)
        return float(sum(mine[(k // p) % v] for k in range(warm)))
    return stage_layers(shape, p) * in_flight(lay.pp_schedule, p, m, v)


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


def _layer_bytes(shape: ModelShape, lay: Layout, tokens: int, ac: str, hold: Holding, eager: bool) -> float:
    """One block's saved bytes for one micro-batch in recomputation mode ``ac`` (ring attention's
    and an MoE block's extra included, averaged over the stage's blocks)."""
    rows = lay.micro_batch_size * tokens
    act = activation_bytes_per_layer(
        shape,
        tokens,
        lay.micro_batch_size,
        lay.tp,
        lay.sequence_parallel,
        ac,
        hold.bpe,
        hold.resid,
        eager,
        hold.unit_cast,
    )
    if lay.cp > 1 and ac != "full":  # ring attention's lse (and fp32 output under bf16)
        act += rows * ring_extra_saved_bytes_per_token(shape.heads / lay.tp, shape.head_dim, hold.bpe)
    moe = moe_costs.activation_delta_bytes(shape, rows, lay.tp, ac, hold.bpe)
    return act + moe_costs.moe_layers_on_stage(shape, lay.pp) / stage_layers(shape, lay.pp) * moe


def step_tensors(
    shape: ModelShape,
    lay: Layout,
    seq: int,
    precision: str,
    compiled: bool,
    loss_chunk_size: int,
    mixed: str,
    cpu: bool,
) -> peak_bytes.StepTensors:
    """One micro-batch's tensors on the most loaded GPU, as planner/peak_bytes.py prices its peaks.
    Per token the parts are planner/activation_bytes.py's; ``cpu``: no fused RMSNorm kernel."""
    hold = holding(precision, on_fsdp(lay, precision, mixed))
    ac, tokens, eager = lay.activation_checkpoint, local_tokens(seq, lay.cp), not compiled
    rows, tp, sp = lay.micro_batch_size * tokens, lay.tp, lay.sequence_parallel
    split, vocab = (tp if sp else 1), shape.vocab_size / tp
    first_ends = rows * (TOKEN_ID_BYTES + (0.0 if hold.unit_cast else rope_bytes_per_token(shape)))
    last_ends = rows * ends_bytes_per_token(shape, hold, loss_chunk_size, eager, tp, sp) - first_ends
    if loss_chunk_size > 0:  # the step holds the hidden states; the chunk's logits and gradient
        output = rows * hold.resid * shape.hidden / split
        loss_working = peak_bytes.chunk_working(rows, vocab, shape.hidden, loss_chunk_size, hold.bpe)
        replaced = 0.0
    else:  # the step holds the logits; the loss's backward peak (loss_bytes) counts them and its saved part
        output = rows * vocab * hold.bpe
        loss_working = loss_bytes(rows, vocab, precision, 0) - output
        replaced = rows * loss_saved_bytes_per_token(shape, hold, 0, eager, tp)
    copies = 0.0
    if ac != "none" and autocast_layout(lay, precision, mixed):  # a recomputed block casts its weights again
        copies = 2 * stage_params(shape, tp, lay.pp)[1]
    return peak_bytes.StepTensors(
        layers=stage_layers(shape, lay.pp),
        block=_layer_bytes(shape, lay, tokens, ac, hold, eager),
        block_whole=_layer_bytes(shape, lay, tokens, "none", hold, eager),
        first_ends=first_ends,
        last_ends=last_ends,
        output=output,
        dy=rows * hold.resid * shape.hidden / split,
        norm_working=rows * peak_bytes.norm_working_per_token(shape, hold, not cpu, tp, sp),
        block_working=rows * peak_bytes.block_working_per_token(shape, hold, ac, eager, tp, sp),
        recomputed_copies=copies,
        loss_working=loss_working,
        loss_replaces_saved=replaced,
        # the loss's saved tensors and (the whole logits) the head's saved input, freed by the norm's backward
        loss_saved=rows * loss_saved_bytes_per_token(shape, hold, loss_chunk_size, eager, tp)
        + (0.0 if loss_chunk_size > 0 else rows * hold.bpe * shape.hidden / split),
        block_grad_share=shape.hidden * shape.ffn_hidden / tp / stage_params(shape, tp, lay.pp)[0]
        if peak_bytes.swiglu_moment(shape, hold, tp, sp)
        else 0.0,
    )


def peak_point(
    shape: ModelShape, lay: Layout, t: peak_bytes.StepTensors, grads: float, all_grads: bool
) -> peak_bytes.PeakPoint:
    """The largest of the step's candidate peaks (planner/peak_bytes.py). ``all_grads``: every
    gradient is alive throughout (accumulation, pipelining, FSDP's reduced shards), else they are
    allocated as backward goes. Pipelined, the first stage holds its in-flight micro-batches'
    activations (``held_layers``) with one block's backward beside them, the last one micro-batch
    with the loss: the larger is the peak."""
    psi, per_layer = stage_params(shape, lay.tp, lay.pp)
    head = (shape.vocab_size * shape.hidden / lay.tp + shape.hidden) / psi if lay.pp == 1 else 0.0
    bottom = head + (t.layers - 1) * per_layer / psi
    shares = (
        {"loss": head, "top": head, "bottom": bottom}
        if not all_grads
        else dict.fromkeys(("loss", "top", "bottom"), 1.0)
    )
    best = max(peak_bytes.points(t, grads, shares), key=lambda x: x.total)
    if lay.pp == 1:
        return best
    held = held_layers(shape, lay)
    first = t.block * held + t.first_ends * max(1.0, held / t.layers)
    work = t.block_whole - t.block + t.recomputed_copies + t.block_working + t.dy
    return peak_bytes.PeakPoint(best.where, first, max(work, best.total - grads - first), grads)


def weight_copy_bytes(
    shape: ModelShape, lay: Layout, psi: float, precision: str, mixed: str = "autocast", loss_chunk_size: int = 0
) -> float:
    """Autocast's bf16 copies of the weights, saved for backward by every matmul that cast them
    (the embedding lookup casts none; a tied head casts the shared table; the chunked loss casts
    the head inside its Function and keeps none). Under selective and full recomputation only the
    head's copy (outside the recomputed blocks) is held in backward: autocast's cast cache holds
    the blocks' copies until the forward's autocast region ends, and a recomputed block casts its
    own again (``step_tensors``: ``recomputed_copies``)."""
    if not autocast_layout(lay, precision, mixed):
        return 0.0
    head = 0.0 if loss_chunk_size > 0 else shape.vocab_size * shape.hidden / lay.tp
    if lay.activation_checkpoint in ("full", "selective"):
        return 2 * head
    untied = 0.0 if shape.tie_embeddings else shape.embedding_params() / lay.tp  # (tied: the table is the head)
    return 2 * (psi - untied - shape.vocab_size * shape.hidden / lay.tp + head)


def _buffers(shape: ModelShape, lay: Layout, psi: float, per_layer: float, precision: str, fsdp: bool) -> float:
    """Communication buckets, FSDP2's gathered parameters, offload staging (bytes). FSDP2 keeps
    the gathered parameters from forward to backward below ZeRO-3 (its stage 0 on a world of one
    or under tp, its replicated DDP layouts cast once, ZeRO-2); ZeRO-3 the running and the
    prefetched block's."""
    psi_e = moe_costs.expert_params_on_stage(shape, lay.tp, lay.pp)  # 0 for a dense model
    w = 2 if precision != "fp32" else 4
    if fsdp and lay.zero_stage < 3:
        gathered = psi * w
    elif fsdp:
        gathered = 2 * per_layer * w
    else:
        gathered = 0.0
    gathered += moe_costs.gathered_delta_bytes(shape, lay, psi_e, w) if lay.dp > 1 else 0.0
    buckets = 2 * 25 * 2**20 if lay.dp * lay.cp > 1 else 0.0  # gradient reduction's buckets (none on one rank)
    buffers = buckets + gathered
    if lay.offload == "cpu":
        buffers += offload_costs.staging_bytes(per_layer, lay.dp * lay.cp)
    return buffers


def memory(
    shape: ModelShape,
    lay: Layout,
    seq: int,
    precision: str,
    hw: Hardware,
    *,
    compiled: bool = True,
    loss_chunk_size: int = LOSS_CHUNK_SIZE,
    mixed: str = "autocast",
) -> dict[str, float]:
    """Device memory per GPU by part (GiB, see the module doc); under CPU offload the model
    states are on the host (``offload_costs``) and only their staging copies stay here.
    ``mixed``: train.mixed_precision as resolved for the device (``cast_once`` or ``autocast``).
    ``activations`` are the saved activations alive at the step's peak and ``working`` what backward
    (or the loss) works with there (planner/peak_bytes.py); ``grads_not_at_peak`` (<= 0): with one
    micro-batch and no pipeline, the gradients not yet allocated there."""
    psi, per_layer = stage_params(shape, lay.tp, lay.pp)
    states = stage_state_bytes(shape, lay, precision)
    if lay.offload == "cpu":
        states = {k: 0.0 for k in states}
    t = step_tensors(shape, lay, seq, precision, compiled, loss_chunk_size, mixed, hw.is_cpu())
    all_grads = not (lay.pp == 1 and lay.num_microbatches <= 1 and lay.zero_stage < 2)
    peak = peak_point(shape, lay, t, states["grads"], all_grads)
    out = {
        "params": states["params"],
        "grads": states["grads"],
        "optimizer": states["optimizer"],
        "activations": peak.saved,
        "working": peak.working,
        "weight_copies": weight_copy_bytes(shape, lay, psi, precision, mixed, loss_chunk_size),
        "buffers": _buffers(shape, lay, psi, per_layer, precision, on_fsdp(lay, precision, mixed)),
        "grads_not_at_peak": peak.grads - states["grads"],
    }
    out = {k: v / GIB for k, v in out.items()}
    out["reserve"] = hw.reserve_gib
    out["total"] = sum(out.values())
    return out


def allocated_gib(mem: dict[str, float]) -> float:
    """What ``torch.cuda.max_memory_allocated`` reads at the peak (meshforge's ``peak_mem_gib``):
    the total less the reserve (CUDA context, library workspaces, allocator fragmentation)."""
    return mem["total"] - mem["reserve"]


def overflow_reason(mem: dict[str, float], hbm_gib: float) -> str:
    """What overflows: the total against the device's memory (a GPU, or a CPU's RAM), the largest
    parts, and whether the model states or the activations alone exceed it (so the fix is more
    sharding or recomputation)."""
    over = mem["total"] - hbm_gib
    parts = sorted((k for k in mem if k != "total"), key=lambda k: -mem[k])[:3]
    msg = f"needs {mem['total']:.1f} GiB of {hbm_gib:.0f} GiB ({over:.1f} over); largest: " + ", ".join(
        f"{k} {mem[k]:.1f}" for k in parts
    )
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    if states > hbm_gib:
        msg += (
            f"; the model states alone ({states:.1f} GiB) exceed the device's memory: shard them (higher zero, tp, pp)"
        )
    elif mem["activations"] > hbm_gib - states:
        msg += "; the activations exceed what the model states leave: recompute, smaller micro-batch, or more tp/cp"
    return msg
