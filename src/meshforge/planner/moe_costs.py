"""What a mixture of experts adds to the planner's memory and time: the routed experts'
parameters and optimizer state under expert parallelism and FSDP, the MoE block's
activations, the experts' gathers, and the token all-to-alls on the link the ep group uses.

As meshforge runs it (parallel/expert/dispatch.py): under ep > 1 each rank holds E/ep
experts of every MoE block, and FSDP2 shards those over the ``edp`` = dp x cp / ep ranks
that hold the same experts, so the expert states per GPU are 16 bytes x Ψe / (dp x cp) in
any precision (the fp32 shards of parameters and gradients plus Adam's), but a gather
only brings in the rank's own E/ep experts, over edp ranks. Under ep = 1 the experts are
ordinary parameters and follow the ZeRO stage like the rest. The all-to-all bytes are the
formula ``a2a_bytes_formula`` the training run logs beside its measured traffic.

The routed experts' GEMMs are priced at their own size (``expert_gemm_seconds``): per
micro-batch a local expert sees tokens x k x ep / (E x tp) rows, far fewer than a dense
GEMM's, so it runs lower on the same efficiency curve; and the busiest ep rank sets the
pace (``expert_imbalance``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from meshforge.models import flops
from meshforge.models.moe import expert_ffn, is_moe_layer
from meshforge.models.shape import ModelShape
from meshforge.parallel.expert.rules import ep_chunks_of
from meshforge.planner import kernel_costs
from meshforge.planner.hardware import Hardware

# Busiest expert's load over the mean under dropless routing when the user's run is not known:
# a default, not a measurement of that run. bench/bench_moe.py measured 1.22 with aux_loss
# balancing at the end of 300 steps (debug-moe, 8 experts, top-2; docs/benchmarks.md).
DEFAULT_EXPERT_IMBALANCE = 1.2

Layout = Any  # planner/estimate.py's Layout (which imports this module)


def moe_layers_on_stage(shape: ModelShape, pp: int) -> int:
    """MoE blocks on the pipeline stage that has the most (stages take ceil(L/p) blocks in order)."""
    if shape.num_experts <= 0:
        return 0
    return _moe_layers_on_stage(shape.layers, shape.first_dense_layers, shape.moe_interval, pp)


@lru_cache(maxsize=1024)
def _moe_layers_on_stage(layers: int, first_dense: int, interval: int, pp: int) -> int:
    grid = SimpleNamespace(num_experts=1, first_dense_layers=first_dense, moe_interval=interval)
    per = -(-layers // pp)
    return max(sum(1 for i in range(s, min(s + per, layers)) if is_moe_layer(grid, i)) for s in range(0, layers, per))


def expert_params_on_stage(shape: ModelShape, tp: int, pp: int) -> float:
    """The routed experts' parameters on the most loaded stage, before ep splits them."""
    return moe_layers_on_stage(shape, pp) * flops.moe_expert_params(shape) / tp


def expert_state_bytes(shape: ModelShape, lay: Layout, psi_e: float, precision: str, dense_states) -> dict[str, float]:
    """Bytes of the experts' parameters, gradients and optimizer state on one GPU.
    ``dense_states(psi)``: how the layout's ZeRO stage keeps ``psi`` ordinary parameters (ep = 1)."""
    if lay.ep <= 1:
        return dense_states(psi_e)
    # 1/ep of the experts, sharded over edp = dp x cp / ep; replicated over tp (each tp rank runs
    # them on its share of the slots: parallel/tensor/moe.py), so x tp of the /tp ``psi_e``
    local = psi_e * lay.tp / (lay.dp * lay.cp)
    return {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local}


def gathered_delta_bytes(shape: ModelShape, lay: Layout, psi_e: float, w: int) -> float:
    """How the experts change the gathered working copies the dense model would hold: under
    ep > 1 a rank gathers only its own E/ep experts (all of them on the stage from forward to
    backward under ZeRO-0/1/2, the running and prefetched block's under ZeRO-3)."""
    if lay.ep <= 1 or psi_e <= 0:
        return 0.0
    layers = max(1, moe_layers_on_stage(shape, lay.pp))
    own = psi_e * lay.tp / lay.ep  # the E/ep experts, whole on every tp rank (see expert_state_bytes)
    if lay.zero_stage == 3:
        return 2 * (own - psi_e) / layers * w
    if lay.zero_stage == 2:
        return (own - psi_e) * w
    return own * w  # the experts' own FSDP units, kept gathered (no reshard)


def activation_delta_bytes(shape: ModelShape, tokens: float, tp: int, recompute: str, bpe: int) -> float:
    """Per MoE block and micro-batch of ``tokens`` tokens: what its feed-forward keeps for
    backward beyond the dense MLP the block model counted. Per token: the router's fp32 logits
    and probabilities (2E x 4 bytes); per chosen expert the dispatched input, the SwiGLU's
    w1/w3 outputs, activation and product (h + 4·f_e; selective: h + 2·f_e) and the returned
    output (h); the shared experts like a dense MLP of their width. Full recomputation keeps
    only the block input, which the block model counts already."""
    if recompute == "full" or shape.num_experts <= 0:
        return 0.0
    fe, k, h = expert_ffn(shape), shape.experts_per_token, shape.hidden
    mlp = 2 if recompute == "selective" else 4
    routed = k * (2 * h + mlp * fe) + mlp * fe * shape.num_shared_experts
    dense = mlp * shape.ffn_hidden
    return tokens * ((routed - dense) * bpe / tp + 8 * shape.num_experts)


def a2a_seconds(
    shape: ModelShape, lay: Layout, tokens_per_rank: float, bpe: int, hw: Hardware, gpus_per_node: int, recompute: str
) -> float:
    """The token all-to-alls of one step on this rank, on the critical path: dispatch and
    combine per MoE block and micro-batch, forward and backward (plus the forward again under
    full recomputation), each over the ep ranks at stride tp (inside a node while tp x ep
    fits in one), with (ep-1) latency steps per exchange and one more for the token counts."""
    if lay.ep <= 1 or shape.num_experts <= 0:
        return 0.0
    from meshforge.parallel.expert.dispatch import a2a_bytes_formula  # (here: it imports FSDP, DTensor)

    sent = a2a_bytes_formula(shape, int(tokens_per_rank), bpe, lay.ep)
    exchanges = 4 * moe_layers_on_stage(shape, lay.pp) * lay.num_microbatches * ep_chunks_of(lay, gpus_per_node)
    if recompute == "full":
        sent, exchanges = sent * 1.5, exchanges * 1.5
    bw, alpha = hw.link("all_to_all", lay.tp * lay.ep <= gpus_per_node)
    return sent / bw + exchanges * 1.25 * (lay.ep - 1) * alpha


def a2a_hidden(a2a_s: float, expert_s: float, lay: Layout, gpus_per_node: int) -> float:
    """Seconds of the all-to-alls that ``parallel.ep_chunks`` = C hides beside the experts'
    GEMMs (parallel/expert/overlap.py): per MoE block and pass the 2C transfers go one at a time,
    each beside another chunk's experts, and only the first dispatch and the last combine wait,
    so a pass hides min(its transfers, its expert GEMMs) x (C-1)/C. Forward and backward move
    the same bytes; backward's GEMMs are twice forward's (a full recomputation adds a forward)."""
    c = ep_chunks_of(lay, gpus_per_node)  # (0: auto, chunked only across nodes)
    if c <= 1 or a2a_s <= 0:
        return 0.0
    fwd = 2 if lay.activation_checkpoint == "full" else 1
    per_pass, gemm = a2a_s / (fwd + 1), expert_s / (fwd + 2)
    return (fwd * min(per_pass, gemm) + min(per_pass, 2 * gemm)) * (c - 1) / c


def tp_seconds(
    shape: ModelShape, lay: Layout, tokens_mb: float, bpe: int, coll: Callable[[str, float], float]
) -> float:
    """What ep x tp adds to a step's tensor-parallel traffic (parallel/tensor/moe.py):
    per MoE block and micro-batch one all-reduce over tp of the slots' outputs in forward and
    one of their input gradients in backward (tokens x k x hidden each; again in forward under
    full recomputation), and once per step the all-reduce over tp that sums the expert
    gradients' partial sums (this rank's fp32 FSDP shard of its experts). ``coll(kind, bytes)``
    prices one collective over the tp group."""
    if lay.tp <= 1 or shape.num_experts <= 0:
        return 0.0
    passes = 3 if lay.activation_checkpoint == "full" else 2
    slots = tokens_mb * shape.experts_per_token * shape.hidden * bpe
    per_step = moe_layers_on_stage(shape, lay.pp) * lay.num_microbatches * passes * coll("all_reduce", slots)
    grad_shard = expert_params_on_stage(shape, lay.tp, lay.pp) * lay.tp / (lay.dp * lay.cp) * 4
    return per_step + coll("all_reduce", grad_shard)


def rows_per_expert(shape: ModelShape, lay: Layout, tokens_mb: float) -> float:
    """Rows of one local expert's GEMM per micro-batch of ``tokens_mb`` tokens on a rank, at
    balance: the rank routes tokens x k slots over E experts; under ep its E/ep experts take the
    slots of its ep group's ep ranks (parallel/expert/dispatch.py), and under ep x tp each tp
    rank takes 1/tp of them (parallel/tensor/moe.py; its tokens_mb is the whole
    micro-batch, gathered in front of the MoE block)."""
    return tokens_mb * shape.experts_per_token * lay.ep / (shape.num_experts * lay.tp)


def expert_imbalance(shape: ModelShape, lay: Layout) -> float:
    """Busiest ep rank's expert rows over the mean. Per expert: min(capacity_factor, default)
    with a capacity factor (the cap is cf x the mean), else the default. It is per rank that
    counts: one expert's time is (flop + half_flop) / rate_max on the gemm_rate curve, so a
    rank's grouped GEMM costs its total rows plus a constant per local expert however those
    rows split among them. A rank holds n = E/ep experts; its load is the mean of n of the
    E loads, whose excess over the mean shrinks like a mean of n draws without replacement,
    by sqrt((E - n) / (n (E - 1))): the whole excess at one expert per rank, none under
    ep = 1 (every rank holds all experts and computes exactly its own tokens x k slots)."""
    e = shape.num_experts
    cf = shape.capacity_factor
    per_expert = min(cf, DEFAULT_EXPERT_IMBALANCE) if cf > 0 else DEFAULT_EXPERT_IMBALANCE
    if per_expert <= 1.0 or e <= 1:  # capped at or below the mean: every expert is (about) full
        return per_expert
    n = e // lay.ep
    return 1.0 + (per_expert - 1.0) * ((e - n) / (n * (e - 1))) ** 0.5


def routed_flops_per_token(shape: ModelShape, recompute: str) -> float:
    """Hardware FLOPs of the routed experts per token over all MoE blocks: 6 x the k chosen
    experts' parameters (forward + backward), 8 x under full recomputation."""
    per_pass = 2.0 * moe_layers_on_stage(shape, 1) * shape.experts_per_token * 3 * shape.hidden * expert_ffn(shape)
    return per_pass * (4 if recompute == "full" else 3)


def expert_gemm_seconds(
    shape: ModelShape, lay: Layout, tokens_mb: float, tokens_gpu: float, hw: Hardware, precision: str
) -> tuple[float, float]:
    """(seconds, of which recomputation) of the routed experts' GEMMs on the busiest rank of
    the most loaded stage: this GPU's share of their FLOPs at the gemm_rate of one expert's
    GEMM (``rows_per_expert`` x hidden x expert ffn), times ``expert_imbalance``."""
    if shape.num_experts <= 0:
        return 0.0, 0.0
    rate = kernel_costs.gemm_rate_dims(
        hw, rows_per_expert(shape, lay, tokens_mb), shape.hidden, expert_ffn(shape), precision
    )
    stage = moe_layers_on_stage(shape, lay.pp) * lay.pp / max(1, moe_layers_on_stage(shape, 1))
    total = (
        routed_flops_per_token(shape, lay.activation_checkpoint)
        * tokens_gpu
        / rate
        * stage
        * expert_imbalance(shape, lay)
    )
    recompute = total / 4 if lay.activation_checkpoint == "full" else 0.0
    return total, recompute
