"""Communication time of one layout's step, per axis (α–β model, see estimate.py's module doc):
tensor-parallel collectives on the critical path less what async TP hides, the ring's K/V
passes, pipeline sends, the data-parallel traffic and what of it the step waits for, and the
host-link copies under CPU offload."""

from __future__ import annotations

from meshforge.config.layout import Layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.data.rules import uses_flat_zero1
from meshforge.parallel.tensor.ring_pieces import pieces_of
from meshforge.planner import kernel_costs, moe_costs, offload_costs, time_terms
from meshforge.planner.context_costs import local_tokens, ring_bytes, ring_messages
from meshforge.planner.hardware import Hardware, cost_coefficients
from meshforge.planner.memory import stage_layers, stage_params, stage_state_bytes

REDUCE_BYTES = {"fp32": 4, "bf16": 2}  # parallel.grad_reduce_dtype: what ZeRO-1 reduce-scatters


def ring_time(kind: str, payload: float, n: int, bw: float, alpha: float) -> float:
    """α–β time of a collective (``cost_coefficients``); ``payload`` is the full
    (unsharded) size in bytes."""
    if n <= 1 or payload <= 0:
        return 0.0
    steps, mult = cost_coefficients(kind, n)
    return mult * payload / bw + steps * alpha


def collective_time(
    hw: Hardware, kind: str, payload: float, inner: int, n: int, gpus_per_node: int, latency: bool = True
) -> float:
    """A ``kind`` collective over ``n`` ranks at stride ``inner``, on the link it crosses
    (with the profile's own figures for that collective where calibrated). ``latency``:
    False where the layout's measured fixed costs include it (``layout_fixed``)."""
    bw, alpha = hw.link(kind, inner * n <= gpus_per_node)
    return ring_time(kind, payload, n, bw, alpha if latency else 0.0)


def bytes_per_element(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def layout_fixed(lay: Layout, hw: Hardware) -> dict[str, float] | None:
    """The measured fixed costs of this layout's kind (hw.layout_fixed_s, a calibrated CPU):
    tensor parallelism's (DTensor) if tp > 1, else FSDP2's for ZeRO-2/3 over several ranks;
    None for plain modules (hw.block_fixed_s and hw.optimizer_fixed_s price those)."""
    if not hw.layout_fixed_s:
        return None
    if lay.tp > 1:
        return hw.layout_fixed_s.get("tp")
    if lay.zero_stage >= 2 and lay.dp * lay.cp > 1:
        return hw.layout_fixed_s.get("fsdp")
    return None


def tp_time(
    shape: ModelShape, lay: Layout, seq: int, precision: str, hw: Hardware, gpus_per_node: int
) -> tuple[float, float]:
    """(all, hidden) seconds of tensor-parallel collectives, on the critical path except what
    async TP hides beside the blocks' GEMMs (``parallel.async_tp``: time_terms.tp_overlap_hidden).
    Per layer and micro-batch two all-reduces of the block's activations in forward and two in backward (each a
    reduce-scatter + all-gather pair under SP), two more when the forward is recomputed; the
    vocab-parallel embedding (forward) and the head's input (backward) one each, on the
    stages holding them; the loss-parallel cross-entropy three small all-reduces; under
    ep x tp the MoE blocks' slot all-reduces (moe_costs.tp_seconds). Under async TP the blocks'
    pairs run as rings of point-to-point sends (each chunk in ``pieces_of`` pieces, sent back to
    back: one latency per ring step), priced at the profile's send_recv link, and so does the
    head's where the logits are computed whole (``train.loss_chunk_size = 0``); the embedding's
    stays DTensor's collective."""
    tokens_mb = lay.micro_batch_size * seq / lay.cp
    act = tokens_mb * shape.hidden * bytes_per_element(precision)
    blocks = stage_layers(shape, lay.pp)
    per_mb = blocks * (6 if lay.activation_checkpoint == "full" else 4)
    ends = 2 if lay.pp == 1 else 1
    latency = layout_fixed(lay, hw) is None  # else measured with the layout's fixed costs

    def tp_coll(kind: str, payload: float) -> float:
        return collective_time(hw, "dtensor_" + kind, payload, 1, lay.tp, gpus_per_node, latency)

    if lay.sequence_parallel:
        one = tp_coll("all_gather", act) + tp_coll("reduce_scatter", act)
    else:
        one = tp_coll("all_reduce", act)
    ring = lay.async_tp and lay.sequence_parallel and lay.tp > 1
    pieces = ring_pieces(seq, lay) if ring else 1
    if ring:
        bw, alpha = hw.link("send_recv", lay.tp <= gpus_per_node)
        block_one = 2 * ring_time("all_gather", act, lay.tp, bw, alpha if latency else 0.0)
    else:
        block_one = one
    # the head's end runs in async TP's ring too where it computes the logits whole (the
    # chunked loss gathers its input with DTensor's collective); priced on a stage of its own only
    head_ring = ring and lay.pp == 1 and hw.loss_chunk_size <= 0
    moe = moe_costs.tp_seconds(shape, lay, tokens_mb, bytes_per_element(precision), tp_coll)
    per_step_ends = ends * one + (block_one - one if head_ring else 0.0)
    total = lay.num_microbatches * (per_mb * block_one + per_step_ends + 3 * tp_coll("all_reduce", tokens_mb * 4)) + moe
    rate = kernel_costs.gemm_rate(
        hw, 2 * tokens_mb * shape.hidden * max(shape.ffn_hidden, shape.hidden) / lay.tp, precision
    )
    hidden = time_terms.tp_overlap_hidden(shape, lay, tokens_mb, block_one / 2, rate, blocks, pieces, head_ring)
    return total, hidden


def ring_pieces(seq: int, lay: Layout) -> int:
    """The pieces each tp rank's sequence chunk travels in under the async TP ring."""
    return pieces_of(max(1, seq // (lay.cp * lay.tp)))


def cp_time(shape: ModelShape, lay: Layout, seq: int, precision: str, hw: Hardware, gpus_per_node: int) -> float:
    """Ring attention: K/V blocks passed around the cp ranks, half of it exposed beside the
    attention compute."""
    if lay.cp <= 1:
        return 0.0
    tokens_mb = lay.micro_batch_size * local_tokens(seq, lay.cp)
    recompute = lay.activation_checkpoint != "none"  # the block's forward, ring included, runs again in backward
    sent = sum(
        ring_bytes(tokens_mb, shape.kv_dim / lay.tp, lay.cp, "ring", bytes_per_element(precision), recompute).values()
    )
    cp_bw, cp_alpha = hw.link("send_recv", lay.tp * lay.cp <= gpus_per_node)
    layers_stage = stage_layers(shape, lay.pp)
    per_layer = sent / cp_bw + ring_messages(lay.cp, "ring", recompute) * cp_alpha
    return 0.5 * layers_stage * lay.num_microbatches * per_layer


def pp_time(shape: ModelShape, lay: Layout, seq: int, precision: str, hw: Hardware, gpus_per_node: int) -> float:
    """Activations (forward) and their gradients (backward) between stages, as the step waits
    for them. torch's 1F1B fires each steady-state send together with the receive it needs next
    and waits for both, so a stage boundary's forward and backward transfers run at once
    (links are full duplex): one transfer's time per exchange, m·v of them in the steady state
    (per micro-batch and model chunk) plus p - 1 in the fill and drain, where the warm-up and
    cool-down sends run asynchronously beside compute. Not inside the bubble: the bubble is
    idle compute, these are the waits beside it (measured: bench/bench_overlap.py's pp row)."""
    if lay.pp <= 1:
        return 0.0
    act = lay.micro_batch_size * seq / lay.cp * shape.hidden * bytes_per_element(precision)
    inner = lay.tp * lay.cp * lay.dp
    exchanges = lay.num_microbatches * lay.pp_virtual_stages + lay.pp - 1
    return exchanges * collective_time(hw, "send_recv", act / lay.tp, inner, lay.pp, gpus_per_node)


def dp_time(
    shape: ModelShape,
    lay: Layout,
    precision: str,
    hw: Hardware,
    gpus_per_node: int,
    psi: float | None = None,
    group: tuple[int, int] | None = None,
) -> float:
    """All data-parallel traffic of one step: DDP's (and ZeRO-1's) gradient all-reduce (plus
    ZeRO-1's parameter all-gather), or FSDP's per-layer gathers and reduce-scatters, whose
    latency is paid once per layer unit. ``psi``: the parameters (default: the stage's);
    ``group``: (ranks, stride) when not the data-parallel ranks (the experts' edp under ep)."""
    psi = stage_params(shape, lay.tp, lay.pp)[0] if psi is None else psi
    dp_n, stride = group or (lay.dp * lay.cp, lay.tp)
    grad_bytes = 4 * psi  # gradients are reduced in fp32
    w = bytes_per_element(precision)

    def dp_coll(kind: str, payload: float) -> float:
        return collective_time(hw, kind, payload, stride, dp_n, gpus_per_node)

    if dp_n == 1:
        return 0.0
    if lay.zero_stage == 0 and group is None:
        return dp_coll("all_reduce", grad_bytes)
    if lay.zero_stage == 1 and group is None:
        after = dp_after_step(shape, lay, precision, hw, gpus_per_node, psi)
        if not uses_flat_zero1(lay, precision):  # ZeroRedundancyOptimizer: DDP's all-reduce, then the broadcasts
            return dp_coll("all_reduce", grad_bytes) + after
        return dp_coll("reduce_scatter", psi * REDUCE_BYTES[lay.grad_reduce_dtype]) + after
    gathers = (2 if lay.zero_stage == 3 else 1) * lay.num_microbatches
    units = max(1, round(stage_layers(shape, lay.pp)))
    latency = group is not None or layout_fixed(lay, hw) is None  # else in the measured fixed costs

    def unit_coll(kind: str, payload: float) -> float:
        return collective_time(hw, kind, payload / units, stride, dp_n, gpus_per_node, latency)

    reduces = lay.num_microbatches if hw.reduce_every_microbatch else 1
    return gathers * units * unit_coll("fsdp_all_gather", psi * w) + reduces * units * unit_coll(
        "fsdp_reduce_scatter", grad_bytes
    )


def dp_after_step(
    shape: ModelShape, lay: Layout, precision: str, hw: Hardware, gpus_per_node: int, psi: float | None = None
) -> float:
    """ZeRO-1's parameter traffic after the optimizer step: the all-gather of the updated bf16
    shards (parallel/data/zero1.py) or ZeroRedundancyOptimizer's broadcast of each rank's fp32
    partition (priced as the all-gather it amounts to). Nothing runs beside it: the next forward
    needs the parameters, so the step waits for all of it (``dp_exposed``). ``psi``: the
    parameters (default: the stage's)."""
    dp_n = lay.dp * lay.cp
    if lay.zero_stage != 1 or dp_n <= 1:
        return 0.0
    psi = stage_params(shape, lay.tp, lay.pp)[0] if psi is None else psi
    return collective_time(hw, "all_gather", psi * bytes_per_element(precision), lay.tp, dp_n, gpus_per_node)


DDP_FIRST_BUCKET = 2**20  # torch DDP's first bucket (the last layers' gradients) is 1 MiB, whatever bucket_cap_mb


def last_reduction_share(shape: ModelShape, lay: Layout, precision: str) -> float:
    """The share of the gradient reduction that starts only when backward ends: FSDP's first
    layer unit (one of the stage's blocks); flat ZeRO-1's last bucket of ``parallel.ddp_bucket_mb``
    of bf16 gradients; torch DDP's (and ZeroRedundancyOptimizer's) last bucket of fp32
    gradients, what follows its 1 MiB first bucket up to ``ddp_bucket_mb``."""
    if lay.zero_stage >= 2:
        return 1.0 / max(1.0, stage_layers(shape, lay.pp))
    flat = uses_flat_zero1(lay, precision)
    grad_bytes = stage_params(shape, lay.tp, lay.pp)[0] * (2 if flat else 4)
    bucket = lay.ddp_bucket_mb * 2**20
    if flat:
        return min(1.0, bucket / grad_bytes)
    if grad_bytes <= DDP_FIRST_BUCKET:
        return 1.0
    return min(bucket, grad_bytes - DDP_FIRST_BUCKET) / grad_bytes


def dp_exposed(
    dp_s: float,
    compute_s: float,
    shape: ModelShape,
    lay: Layout,
    hw: Hardware,
    interference_scale: float = 1.0,
    after_s: float = 0.0,
    precision: str = "bf16",
) -> float:
    """What of the data-parallel traffic the step waits for: the last bucket's (layer unit's,
    ``last_reduction_share``) reduction waits for the end of backward; the rest hides under the ZeRO-3 prefetch
    window (forward and backward) or backward, as far as the hardware runs communication
    beside compute (hw.comm_overlap). ``after_s`` of it (ZeRO-1's parameter all-gather after the
    step, ``dp_after_step``) waits whole. Hidden traffic is not free: the collective kernels
    take SMs and memory bandwidth from the compute they run beside (hw.comm_interference), in
    proportion to the bytes they move per second (``interference_scale``: the link's share of
    the in-node bandwidth)."""
    hideable = dp_s - after_s
    window = compute_s * (0.9 if lay.zero_stage == 3 else 0.6)
    last_bucket = hideable * last_reduction_share(shape, lay, precision) if lay.dp * lay.cp > 1 else 0.0
    hidden = min((hideable - last_bucket) * hw.comm_overlap, window)
    return dp_s - hidden + hidden * hw.comm_interference * interference_scale


def dp_link_share(lay: Layout, hw: Hardware, gpus_per_node: int) -> float:
    """The data-parallel link's bandwidth as a share of the in-node one (1 inside a node)."""
    if lay.tp * lay.dp * lay.cp <= gpus_per_node:
        return 1.0
    return min(1.0, hw.inter_bw / hw.intra_bw)


def offload_time(
    shape: ModelShape, lay: Layout, precision: str, hw: Hardware, gpus_per_node: int, dp_s: float, compute_s: float
) -> tuple[float, float, float]:
    """(exposed host-link seconds, all host-link seconds, CPU optimizer seconds) under CPU
    offload (planner/offload_costs.py). The copies are chained to the data-parallel traffic: a
    unit's shard goes up on the all-gather's copy-in stream right before its all-gather (so it
    rides the same prefetch), its gradient shard down right after its reduce-scatter. So they
    hide under the same window, in what the dp traffic leaves of it, as far as comm_overlap
    allows, and the last unit's share waits: exposed is what dp traffic plus copies expose
    beyond the dp traffic alone. Hidden copies cost the compute nothing (copy engines, no SMs;
    ~50 GB/s is noise beside HBM's), so neither side charges interference."""
    psi, _ = stage_params(shape, lay.tp, lay.pp)
    link_s = offload_costs.link_seconds(psi, lay.dp * lay.cp, lay.zero_stage, lay.num_microbatches, hw)
    exposed = dp_exposed(dp_s + link_s, compute_s, shape, lay, hw, 0.0) - dp_exposed(
        dp_s, compute_s, shape, lay, hw, 0.0
    )
    opt_s = offload_costs.cpu_optimizer_seconds(stage_state_bytes(shape, lay, precision), hw)
    return exposed, link_s, opt_s
