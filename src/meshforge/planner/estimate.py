"""Memory and step time of one layout, each as an explained breakdown.

Memory per GPU (the most loaded pipeline stage):

- model states by ZeRO stage over the N data-parallel ranks (ZeRO paper, Rajbhandari et al.
  2020), for Ψ parameters on this GPU (after tp and pp): mixed precision (bf16) keeps 2Ψ
  parameters, 2Ψ gradients and 12Ψ of optimizer state (fp32 master, Adam m and v); fp32
  keeps 4Ψ, 4Ψ, 8Ψ. Stage 1 divides the optimizer state by N, stage 2 also the gradients,
  stage 3 everything;
- activations per layer and micro-batch, after Korthikanti et al. 2022: for a GPT block
  (4h GeLU MLP, materialised attention) s·b·h·(34 + 5·a·s/h) bytes, divided by t under TP
  with SP (without SP the 10·s·b·h of norms and dropout stay whole); selective
  recomputation drops the 5·a·s²·b attention part, full recomputation keeps only the
  2·s·b·h block input. A Llama block (SwiGLU, flash attention, no dropout) stores, per token,
  bf16 copies of 6h + 2·kv_dim + 4·ffn elements (norm inputs and outputs, q/k/v, the
  attention output, the three MLP inputs and the product); selective keeps the matmul
  outputs only (4h + 2·kv_dim + 2·ffn), full only the input (h);
- in-flight micro-batches by schedule on the first stage: GPipe all m, 1F1B min(m, p),
  interleaved 1F1B p·(1 + (p−1)/(p·v)) stage-chunks (Narayanan et al. 2021);
- embedding/head on the first/last stage, the loss's fp32 logits (vocab-parallel under tp),
  gathered parameters under ZeRO-2/3, communication buckets and a fixed reserve;
- under CPU offload (``Layout.offload``, planner/offload_costs.py) the model states are in
  host memory (``Estimate.host_memory``) and only fp32 staging copies stay on the device; the
  host-link copies ride the data-parallel prefetch window and the optimizer step runs on the
  CPU at host memory bandwidth.

Time per step: GEMM FLOPs at a size-dependent efficiency (an MoE's routed experts at the
size of one expert's GEMM, times the busiest ep rank's load: moe_costs.expert_gemm_seconds),
the attention core at its own
efficiency, and memory-bound elementwise passes (norms, residuals, activations); TP
collectives on the critical path (4 all-reduces per layer and micro-batch, each a
reduce-scatter + all-gather pair under SP, 2 more with full recompute, and the
embedding's and head's); data-parallel traffic hidden under backward (DDP/ZeRO-1/2) or
under forward and backward (ZeRO-3 prefetch), as far as the hardware overlaps
communication with compute (``comm_overlap``: ~1 for NCCL, ~0 for gloo on a CPU), except
what exceeds it, FSDP paying one collective's latency per layer; pipeline bubble
(p−1)/(m+p−1), divided by v for interleaving and by 3 for zero-bubble; the optimizer step
as a memory-bound pass over its state. α–β model per collective: a ring over n ranks moves
(n−1)/n of the payload per rank per all-gather or reduce-scatter (twice for all-reduce) at
the bandwidth of the slowest link it crosses, plus (n−1)·α; a calibrated profile has its
own α and bandwidth for each collective as training issues it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from meshforge.config.layout import Layout
from meshforge.models import flops
from meshforge.models.shape import ModelShape
from meshforge.parallel.pipeline.schedules import SCHEDULES as DIMS_SCHEDULES
from meshforge.parallel.pipeline.schedules import V_SHAPED, bubble_fraction
from meshforge.planner import comm_time as comm
from meshforge.planner import document_costs, kernel_costs, moe_costs, offload_costs, time_terms
from meshforge.planner.hardware import GIB, Hardware
from meshforge.planner.memory import (
    memory,
    model_state_bytes,
    overflow_reason,
    stage_layers,
    stage_params,
    stage_state_bytes,
)

# the pipeline schedules and their bubble are the layout rules' (parallel/rules.py)
SCHEDULES = tuple(s for s in DIMS_SCHEDULES if s not in V_SHAPED)  # searched
V_SCHEDULES = V_SHAPED  # planned when asked for (--schedule), two chunks per rank


def run_layout(lay: Layout) -> Layout:
    """The layout as ``--emit-config`` states it to ``meshforge train``: a pipeline's
    micro-batches as a count, otherwise as a size."""
    if lay.pp > 1:
        return lay.replace(micro_batch_size=0)
    return lay.replace(num_microbatches=0)


JSON_SETTINGS = (
    "zero_stage",
    "micro_batch_size",
    "num_microbatches",
    "activation_checkpoint",
    "pp_virtual_stages",
    "pp_schedule",
    "sequence_parallel",
    "async_tp",
    "offload",
)


def plan_layout(tp: int = 1, pp: int = 1, dp: int = 1, **settings: Any) -> Layout:
    """A layout as the planner prices it: its dp ranks shard (dp_replicate 1; ``--emit-config``
    writes them so), one sequence per micro-batch unless given."""
    return Layout(tp=tp, pp=pp, dp_shard=dp, **{"micro_batch_size": 1, "num_microbatches": 1, **settings})


@dataclass
class Estimate:
    layout: Layout
    num_params: int
    memory: dict[str, float]  # GiB on the device
    fits: bool
    overflow: str
    time: dict[str, float]  # seconds
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    budget: dict[str, float] = field(default_factory=dict)  # fractions of the step
    not_runnable: str = ""  # why `meshforge train` refuses this layout (parallel/rules.py); "" if it runs
    host_memory: dict[str, float] = field(default_factory=dict)  # GiB under CPU offload (per GPU, per_node)

    def as_json(self) -> dict[str, Any]:
        lay = asdict(self.layout)
        return {
            **{k: lay[k] for k in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep")},
            "num_params": self.num_params,
            **{k: lay[k] for k in JSON_SETTINGS},
            "memory_gib": {k: round(v, 3) for k, v in self.memory.items()},
            "host_memory_gib": {k: round(v, 3) for k, v in self.host_memory.items()},
            # every part in bytes too (the GiB above are rounded to 3 decimals, ~1 MiB); "device" is the
            # total, "host" and "host_per_node" what CPU offload keeps in host memory
            "memory_bytes": {
                **{k: round(v * GIB) for k, v in self.memory.items()},
                "device": round(self.memory["total"] * GIB),
                "host": round(self.host_memory.get("total", 0.0) * GIB),
                "host_per_node": round(self.host_memory.get("per_node", 0.0) * GIB),
            },
            "host_memory_bytes": {k: round(v * GIB) for k, v in self.host_memory.items()},
            "fits": self.fits,
            "overflow": self.overflow,
            "runnable": not self.not_runnable,
            "not_runnable": self.not_runnable,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "time_s": {k: round(v, 6) for k, v in self.time.items()},
            "loss_budget": {k: round(v, 4) for k, v in self.budget.items()},
        }


# ----------------------------------------------------------------------------- time


def gemm_efficiency(hw: Hardware, flop: float) -> float:
    return hw.gemm_efficiency * flop / (flop + hw.gemm_half_flop)


def _compute_time(
    shape: ModelShape, lay: Layout, seq: int, global_batch: int, precision: str, hw: Hardware
) -> dict[str, float]:
    """This GPU's share of the hardware FLOPs, in seconds (planner/kernel_costs.py): GEMMs at
    the rate of their typical size (an MoE's routed experts at theirs, planner/moe_costs.py),
    the attention core by kernel and sequence length, and the block type's memory-bound
    element-wise work. The slowest (most loaded) pipeline stage
    sets the pace."""
    n_gpus = lay.tp * lay.pp * lay.dp * lay.cp
    peak = hw.peak(precision)
    tokens_mb = lay.micro_batch_size * seq / lay.cp  # tokens per micro-batch on one GPU
    imbalance = time_terms.stage_imbalance(shape, lay, seq, stage_layers(shape, lay.pp))
    tokens_gpu = global_batch * seq / n_gpus
    attn_flops = 3.0 * flops.attention_flops_per_token(shape, seq) * tokens_gpu
    if lay.activation_checkpoint in ("full", "selective"):
        attn_flops *= 4 / 3
    # full recomputation reruns the blocks' forward but for each block's last GEMM, never the head's
    # (models/flops.recomputed_matmul_params: what runs, held to a step by tests/unit/test_gemm_census.py)
    flops_step = shape.hardware_flops_per_token(seq, lay.activation_checkpoint) * tokens_gpu
    rate = kernel_costs.dense_gemm_rate(shape, hw, tokens_mb, lay.tp, precision)
    attn_s = kernel_costs.attention_seconds(
        shape, hw, seq, tokens_gpu, shape.layers, lay.activation_checkpoint, precision, rate
    ) * document_costs.attention_share(seq, lay, hw.mean_doc_len)
    span = document_costs.flops_span(seq, hw.mean_doc_len)
    # the routed experts' GEMMs at their own (smaller) size and load (moe_costs; 0 if dense)
    routed_flops = moe_costs.routed_flops_per_token(shape, lay.activation_checkpoint) * tokens_gpu
    expert_s, expert_recompute_s = moe_costs.expert_gemm_seconds(shape, lay, tokens_mb, tokens_gpu, hw, precision)
    gemm_s = imbalance * ((flops_step - attn_flops - routed_flops) / rate + attn_s) + expert_s
    bpe = comm.bytes_per_element(precision)
    other_s = imbalance * kernel_costs.elementwise_seconds(
        shape, hw, tokens_gpu, shape.layers, lay.activation_checkpoint, bpe, 1 if lay.sequence_parallel else lay.tp
    )
    recompute_flops = flops_step - shape.model_flops_per_token(seq) * tokens_gpu
    routed_recompute = routed_flops / 4 if lay.activation_checkpoint == "full" else 0.0
    recompute_s = (recompute_flops - routed_recompute) / rate + expert_recompute_s
    other_s += _dispatch_time(shape, lay, hw)
    if not hw.is_cpu() and not hw.elementwise_bytes_per_hidden:  # a CPU profile measures its own
        other_s += kernel_costs.loss_seconds(shape, hw, tokens_gpu * lay.pp, lay.tp, hw.eager)  # the last stage's
    return {
        "ideal_compute": shape.model_flops_per_token(span) * tokens_gpu / peak,
        "span": span,  # attention's keys per query as executed (document masks: planner/document_costs.py)
        "gemm": gemm_s,
        "non_gemm": other_s,
        "recompute": recompute_s,
        "expert": expert_s,
    }


def _dispatch_time(shape: ModelShape, lay: Layout, hw: Hardware) -> float:
    """Per-op costs whatever the size (measured on a CPU): every block on the stage, every
    micro-batch, forward + backward (+ the recomputed forward), plus the embedding, head and
    loss - as measured for the layout's kind (``layout_fixed``), or as about one plain block more."""
    passes = 4 / 3 if lay.activation_checkpoint != "none" else 1.0
    blocks = stage_layers(shape, lay.pp) * passes
    kind = comm.layout_fixed(lay, hw)
    if kind:
        return lay.num_microbatches * (kind["block"] * blocks + kind["ends"])
    per_block = hw.tp_block_fixed_s if lay.tp > 1 and hw.tp_block_fixed_s else hw.block_fixed_s
    return per_block * lay.num_microbatches * (blocks + 1)


def _optimizer_time(shape: ModelShape, lay: Layout, precision: str, hw: Hardware) -> float:
    """The optimizer step: a memory-bound pass (read and write) over this GPU's state."""
    psi, _ = stage_params(shape, lay.tp, lay.pp)
    opt_state = model_state_bytes(psi, lay.dp * lay.cp, lay.zero_stage, precision)
    kind = comm.layout_fixed(lay, hw)  # per-tensor costs (and, for a measured kind, reduction and clipping)
    if kind:
        fixed = kind["block_step"] * stage_layers(shape, lay.pp) + kind["ends_step"]
    else:
        fixed = hw.optimizer_fixed_s * (stage_layers(shape, lay.pp) + 1)
    return 2 * (opt_state["optimizer"] + opt_state["grads"] + opt_state["params"]) / hw.hbm_bw + fixed


def _fit(mem: dict[str, float], host: dict[str, float], hw: Hardware) -> tuple[bool, str]:
    """Whether the device memory fits, and (offload, where the node's host memory is known) the
    host state of the node's ranks; else what overflows."""
    if mem["total"] > hw.hbm_gib:
        return False, overflow_reason(mem, hw.hbm_gib)
    if host and hw.host_mem_gib and host["per_node"] > hw.host_mem_gib:
        return False, (
            f"host memory: the offloaded state of a node's ranks needs {host['per_node']:.0f} GiB of "
            f"{hw.host_mem_gib:.0f} GiB per node; more GPUs (dp) or more sharding"
        )
    return True, ""


def _budget(time: dict[str, float], recompute_s: float, step: float) -> dict[str, float]:
    """Where the step goes, as fractions of it (useful work at peak first)."""
    return {
        "useful_at_peak": time["ideal_compute"] / step,
        "matmul_inefficiency": (time["gemm"] - recompute_s - time["ideal_compute"]) / step,
        "recompute": recompute_s / step,
        "non_gemm": time["non_gemm"] / step,
        "tp_exposed": time["tp_comm"] / step,
        "cp_exposed": time["cp_comm"] / step,
        "pp_p2p": time["pp_p2p"] / step,
        "ep_a2a": time["ep_a2a"] / step,
        "dp_exposed": time["dp_comm_exposed"] / step,
        "offload_exposed": time["offload_copy"] / step,
        "bubble": time["bubble"] / step,
        "optimizer": time["optimizer"] / step,
    }


def _comm(
    shape: ModelShape, lay: Layout, seq: int, global_batch: int, precision: str, hw: Hardware, gpus_per_node: int
) -> dict[str, float]:
    """Each axis's communication seconds in one step (comm_time.py); ``dp`` is all of the
    data-parallel traffic, the experts' share over edp under ep."""
    n_gpus = lay.tp * lay.pp * lay.dp * lay.cp
    tp_all, tp_hidden = comm.tp_time(shape, lay, seq, precision, hw, gpus_per_node)
    dp_s = comm.dp_time(shape, lay, precision, hw, gpus_per_node)
    if lay.ep > 1:  # the experts' 1/ep share (whole on each tp rank) is gathered and reduced over edp only
        psi_e = moe_costs.expert_params_on_stage(shape, lay.tp, lay.pp)
        edp = (lay.dp * lay.cp // lay.ep, lay.tp * lay.ep)
        dp_s = max(0.0, dp_s + comm.dp_time(shape, lay, precision, hw, gpus_per_node, psi_e * lay.tp / lay.ep, edp))
        dp_s = max(0.0, dp_s - comm.dp_time(shape, lay, precision, hw, gpus_per_node, psi_e))
    bpe, ac = comm.bytes_per_element(precision), lay.activation_checkpoint
    return {
        "tp": tp_all - tp_hidden,
        "tp_hidden": tp_hidden,
        "cp": comm.cp_time(shape, lay, seq, precision, hw, gpus_per_node),
        "pp": comm.pp_time(shape, lay, seq, precision, hw, gpus_per_node),
        "dp": dp_s,
        "ep": moe_costs.a2a_seconds(shape, lay, global_batch * seq / n_gpus, bpe, hw, gpus_per_node, ac),
    }


def estimate(
    shape: ModelShape, lay: Layout, seq: int, global_batch: int, precision: str, hw: Hardware, gpus_per_node: int
) -> Estimate:
    """Memory and step time of one layout, each as a breakdown (see the module doc)."""
    n_gpus = lay.tp * lay.pp * lay.dp * lay.cp
    hw = hw.for_ranks(min(n_gpus, gpus_per_node))  # a CPU rank's threads: cores / local ranks
    mem = memory(
        shape, lay, seq, precision, hw, compiled=not hw.eager, loss_chunk_size=hw.loss_chunk_size, mixed=hw.mixed()
    )
    host: dict[str, float] = {}
    if lay.offload == "cpu":
        host = offload_costs.host_memory_gib(stage_state_bytes(shape, lay, precision), min(gpus_per_node, n_gpus))
    fits, overflow = _fit(mem, host, hw)
    comp = _compute_time(shape, lay, seq, global_batch, precision, hw)
    c = _comm(shape, lay, seq, global_batch, precision, hw, gpus_per_node)
    compute_s = comp["gemm"] + comp["non_gemm"]
    ep_hidden = moe_costs.a2a_hidden(c["ep"], comp["expert"], lay, gpus_per_node)
    after = comm.dp_after_step(shape, lay, precision, hw, gpus_per_node)
    if lay.ep > 1:  # (the experts' share is reduced over edp by FSDP, not ZeRO-1)
        after -= comm.dp_after_step(
            shape, lay, precision, hw, gpus_per_node, moe_costs.expert_params_on_stage(shape, lay.tp, lay.pp)
        )
    share = comm.dp_link_share(lay, hw, gpus_per_node)
    dp_exposed = comm.dp_exposed(c["dp"], compute_s, shape, lay, hw, share, max(0.0, after), precision)
    bubble = bubble_fraction(lay.pp_schedule, lay.pp, lay.num_microbatches, lay.pp_virtual_stages)
    # the bubble is over the per-micro-batch work
    pipelined = compute_s + c["tp"] + c["cp"] + c["ep"] - ep_hidden
    opt_s = _optimizer_time(shape, lay, precision, hw)
    off_exposed = off_total = 0.0
    if lay.offload == "cpu":
        off_exposed, off_total, opt_s = comm.offload_time(shape, lay, precision, hw, gpus_per_node, c["dp"], compute_s)
    time = {
        **{k: comp[k] for k in ("ideal_compute", "gemm", "non_gemm")},
        **{"tp_comm": c["tp"], "tp_comm_hidden": c["tp_hidden"], "cp_comm": c["cp"], "pp_p2p": c["pp"]},
        **{"ep_a2a": c["ep"] - ep_hidden, "ep_a2a_hidden": ep_hidden},
        **{"dp_comm_total": c["dp"], "dp_comm_exposed": dp_exposed},
        **{"offload_copy": off_exposed, "offload_copy_total": off_total},
        **{"bubble": pipelined * bubble / (1 - bubble), "optimizer": opt_s},
    }
    step = pipelined + time["bubble"] + c["pp"] + dp_exposed + off_exposed + opt_s
    tps = global_batch * seq / step / n_gpus
    peak = hw.peak(precision)
    mfu = shape.model_flops_per_token(comp["span"]) * tps / peak  # active parameters for an MoE (models/flops.py)
    hfu = shape.hardware_flops_per_token(comp["span"], lay.activation_checkpoint) * tps / peak
    budget = _budget(time, comp["recompute"], step)
    return Estimate(lay, shape.num_params(), mem, fits, overflow, time, step, tps, mfu, hfu, budget, host_memory=host)
