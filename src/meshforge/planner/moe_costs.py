"""What a mixture of experts adds to the planner's memory and time: the routed experts'
parameters and optimizer state under expert parallelism and FSDP, the MoE block's
activations, the experts' gathers, and the token all-to-alls on the link the ep group uses.

As meshforge runs it (parallel/expert_parallel.py): under ep > 1 each rank holds E/ep
experts of every MoE block, and FSDP2 shards those over the ``edp`` = dp x cp / ep ranks
that hold the same experts, so the expert states per GPU are 16 bytes x Ψe / (dp x cp) in
any precision (the fp32 shards of parameters and gradients plus Adam's), but a gather
only brings in the rank's own E/ep experts, over edp ranks. Under ep = 1 the experts are
ordinary parameters and follow the ZeRO stage like the rest. The all-to-all bytes are the
formula ``a2a_bytes_formula`` the training run logs beside its measured traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from meshforge.models import flops
from meshforge.models.moe import expert_ffn, is_moe_layer
from meshforge.parallel.expert_parallel import a2a_bytes_formula
from meshforge.planner.hardware import Hardware
from meshforge.planner.shape import Shape

Layout = Any  # planner/estimate.py's Layout (which imports this module)


def moe_layers_on_stage(shape: Shape, pp: int) -> int:
    """MoE blocks on the pipeline stage that has the most (stages take ceil(L/p) blocks in order)."""
    if shape.num_experts <= 0:
        return 0
    return _moe_layers_on_stage(shape.layers, shape.first_dense_layers, shape.moe_interval, pp)


@lru_cache(maxsize=1024)
def _moe_layers_on_stage(layers: int, first_dense: int, interval: int, pp: int) -> int:
    grid = SimpleNamespace(num_experts=1, first_dense_layers=first_dense, moe_interval=interval)
    per = -(-layers // pp)
    return max(sum(1 for i in range(s, min(s + per, layers)) if is_moe_layer(grid, i)) for s in range(0, layers, per))


def expert_params_on_stage(shape: Shape, tp: int, pp: int) -> float:
    """The routed experts' parameters on the most loaded stage, before ep splits them."""
    return moe_layers_on_stage(shape, pp) * flops.moe_expert_params(shape) / tp


def expert_state_bytes(shape: Shape, lay: Layout, psi_e: float, precision: str, dense_states) -> dict[str, float]:
    """Bytes of the experts' parameters, gradients and optimizer state on one GPU.
    ``dense_states(psi)``: how the layout's ZeRO stage keeps ``psi`` ordinary parameters (ep = 1)."""
    if lay.ep <= 1:
        return dense_states(psi_e)
    # 1/ep of the experts, sharded over edp = dp x cp / ep; replicated over tp (each tp rank runs
    # them on its share of the slots: parallel/moe_tensor_parallel.py), so x tp of the /tp ``psi_e``
    local = psi_e * lay.tp / (lay.dp * lay.cp)
    return {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local}


def gathered_delta_bytes(shape: Shape, lay: Layout, psi_e: float, w: int) -> float:
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


def activation_delta_bytes(shape: Shape, tokens: float, tp: int, recompute: str, bpe: int) -> float:
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
    shape: Shape, lay: Layout, tokens_per_rank: float, bpe: int, hw: Hardware, gpus_per_node: int, recompute: str
) -> float:
    """The token all-to-alls of one step on this rank, on the critical path: dispatch and
    combine per MoE block and micro-batch, forward and backward (plus the forward again under
    full recomputation), each over the ep ranks at stride tp (inside a node while tp x ep
    fits in one), with (ep-1) latency steps per exchange and one more for the token counts."""
    if lay.ep <= 1 or shape.num_experts <= 0:
        return 0.0
    sent = a2a_bytes_formula(shape, int(tokens_per_rank), bpe, lay.ep)
    exchanges = 4 * moe_layers_on_stage(shape, lay.pp) * lay.num_microbatches
    if recompute == "full":
        sent, exchanges = sent * 1.5, exchanges * 1.5
    bw, alpha = hw.link("all_to_all", lay.tp * lay.ep <= gpus_per_node)
    return sent / bw + exchanges * 1.25 * (lay.ep - 1) * alpha


def tp_seconds(shape: Shape, lay: Layout, tokens_mb: float, bpe: int, coll: Callable[[str, float], float]) -> float:
    """What ep x tp adds to a step's tensor-parallel traffic (parallel/moe_tensor_parallel.py):
    per MoE block and micro-batch one all-reduce over tp of the slots' outputs in forward and
    one of their input gradients in backward (tokens x k x hidden each; again in forward under
    full recomputation), and once per step the all-reduce over tp that sums the expert
    gradients' partial sums (this rank's fp32 FSDP shard of its experts). ``coll(kind, bytes)``
    prices one collective over the tp group."""
    if lay.tp <= 1 or shape.num_experts <= 0:
        return 0.0
    passes = 3 if lay.recompute == "full" else 2
    slots = tokens_mb * shape.experts_per_token * shape.hidden * bpe
    per_step = moe_layers_on_stage(shape, lay.pp) * lay.num_microbatches * passes * coll("all_reduce", slots)
    grad_shard = expert_params_on_stage(shape, lay.tp, lay.pp) * lay.tp / (lay.dp * lay.cp) * 4
    return per_step + coll("all_reduce", grad_shard)
