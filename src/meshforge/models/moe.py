"""Mixture-of-experts feed-forward, written for one device: a router, stacked SwiGLU
experts, optional shared experts, capacity and load balance.

Per token the router scores every expert in fp32 (softmax or sigmoid), picks the top k
(with DeepSeek-V3's balance bias added for the choice only), and weights the chosen
experts' outputs by their scores (renormalised to sum to 1 with ``norm_topk``). Tokens are
sorted by expert and the experts run as one grouped GEMM (``torch._grouped_mm``) where the
installed PyTorch runs it for the device and dtype, else as an exact loop over experts.

Seams for parallelism (the model knows nothing of it): the sorted tokens and per-expert
counts go through ``MoE.dispatcher`` (a parameter-free module; expert parallelism swaps it
for an all-to-all one, the way context parallelism swaps ``attention.core``), the balance
loss counts a micro-batch's slots per expert through ``MoE.balance_counts`` (context
parallelism sums them over the ranks holding the sequences' other shards), and the
experts and the router read their weights through ``local_weight`` (the local value of a
DTensor).

Parameter names (what checkpoints and Hugging Face export key on): ``router.weight``
[E, hidden], ``experts.w1`` / ``experts.w3`` [E, ffn, hidden], ``experts.w2`` [E, hidden,
ffn] -- expert i is a slice -- and ``shared.w1.weight`` etc. The balance bias is the
buffer ``expert_bias`` [E] (training state: saved in checkpoints).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.compat import grouped_mm, grouped_mm_supported
from meshforge.models.loss import report_aux

ShapeLike = Any  # a ModelShape (duck-typed: this file must not import llama.py, which imports it)


def is_moe_layer(shape: ShapeLike, layer_id: int) -> bool:
    """Block ``layer_id`` has a mixture-of-experts feed-forward: MoE is on (num_experts > 0),
    the block is past ``first_dense_layers`` and on the ``moe_interval`` grid counted from there."""
    if getattr(shape, "num_experts", 0) <= 0 or layer_id < shape.first_dense_layers:
        return False
    return (layer_id - shape.first_dense_layers) % max(1, shape.moe_interval) == 0


def expert_ffn(shape: ShapeLike) -> int:
    """The hidden size of one expert (model.moe_ffn_hidden; 0: model.ffn_hidden)."""
    return shape.moe_ffn_hidden or shape.ffn_hidden


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert weight: the local shard of a DTensor (differentiable), else itself."""
    return w.to_local() if hasattr(w, "to_local") else w


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the grouped GEMM's
    backward refuses expanded (stride-0) gradients such as ``out.sum()`` gives."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing's
    recomputation), where counting and reporting again would count twice. The autograd
    engine's current graph task is private API, read here only."""
    return torch._C._current_graph_task_id() != -1


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
    """Rows of ``x`` (sorted by group, ``counts[g]`` rows in group g) times ``w[g].T``:
    (T, k) x (G, n, k) -> (T, n). ``grouped``: force the grouped GEMM (True) or the loop
    (False); None: the grouped GEMM where supported."""
    if grouped is None:
        grouped = grouped_mm_supported(x.device, x.dtype) and x.dtype == w.dtype
    if grouped and x.shape[0]:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(grouped_mm(x, w.transpose(-2, -1), offs))
    outs = [xi @ w[g].t() for g, xi in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; ``forward`` takes tokens sorted by expert."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.grouped: bool | None = None  # None: grouped GEMM where supported (see grouped_matmul)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (T, hidden) sorted by local expert, ``counts`` (local experts,) -> (T, hidden)."""
        w1, w2, w3 = (local_weight(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        h = F.silu(grouped_matmul(x, w1, counts, self.grouped)) * grouped_matmul(x, w3, counts, self.grouped)
        return grouped_matmul(h, w2, counts, self.grouped)


class LocalDispatch(nn.Module):
    """One device: the sorted tokens go straight to the experts (expert parallelism swaps
    this for an all-to-all dispatch and combine)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        return experts(x, counts)


class LocalCounts(nn.Module):
    """One device: all of a micro-batch's routed slots per expert are counted here (context
    parallelism swaps this for a sum over the ranks holding the other shards of its sequences)."""

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


class SharedExperts(nn.Module):
    """Always-on experts, as one SwiGLU of num_shared x moe_ffn_hidden columns."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Routing:
    """One micro-batch's routing: per (token, slot) the expert, weight and whether it was kept."""

    def __init__(self, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor):
        self.experts, self.weights, self.keep = experts, weights, keep


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of one block (see the module docstring)."""

    def __init__(self, shape: ShapeLike):
        super().__init__()
        e, ffn = shape.num_experts, expert_ffn(shape)
        self.num_experts, self.top_k = e, shape.experts_per_token
        self.router_score, self.norm_topk = shape.router_score, shape.norm_topk
        self.capacity_factor, self.load_balance = shape.capacity_factor, shape.load_balance
        self.aux_loss_coeff, self.z_loss_coeff = shape.aux_loss_coeff, shape.z_loss_coeff
        self.bias_update_rate = shape.bias_update_rate
        self.router = nn.Linear(shape.hidden, e, bias=False)
        self.experts = GroupedExperts(e, shape.hidden, ffn)
        self.shared = SharedExperts(shape.hidden, ffn * shape.num_shared_experts) if shape.num_shared_experts else None
        self.dispatcher: nn.Module = LocalDispatch()
        self.balance_counts: nn.Module = LocalCounts()  # the micro-batch's slots per expert, for f_i
        if self.load_balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(e))
        # since the last optimizer step (training forwards only): tokens per expert, and dropped / routed
        # slots. Plain attributes, not buffers: DDP would overwrite every rank's with rank 0's.
        self.load = torch.zeros(e)
        self.drops = torch.zeros(2)
        self.step_load: torch.Tensor | None = None  # the last step's load and drops (set by end_step)
        self.step_drops: torch.Tensor | None = None
        self.step_load_global = False  # whether step_load is already summed over the data-parallel ranks

    def init_buffers(self) -> None:
        """Zero the training-state buffers (after ``to_empty``; weights come from init_weights)."""
        if hasattr(self, "expert_bias"):
            self.expert_bias.zero_()
        self.load, self.drops = torch.zeros_like(self.load), torch.zeros_like(self.drops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = self.route(flat)
        order = torch.argsort(r.experts.flatten(), stable=True)  # slots grouped by expert
        if self.capacity_factor > 0:  # (dropless: every slot is kept; no mask, no host sync)
            order = order[r.keep.flatten()[order]]
        counts = torch.bincount(r.experts.flatten()[order], minlength=self.num_experts)
        tokens = order // self.top_k
        out = self.dispatcher(flat[tokens], counts, self.experts)
        out = out * r.weights.flatten()[order, None].to(out.dtype)
        y = torch.zeros_like(flat).index_add_(0, tokens, out.to(flat.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(shape)

    def route(self, x: torch.Tensor) -> Routing:
        """Scores in fp32, top-k choice, weights, capacity; reports the balance terms."""
        logits = F.linear(x.float(), local_weight(self.router.weight).float())
        probs = logits.softmax(-1) if self.router_score == "softmax" else logits.sigmoid()
        choice = probs + self.expert_bias if self.load_balance == "bias" else probs
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        keep = self._capacity(experts, weights, x.shape[0])
        if self.training and torch.is_grad_enabled():  # not evaluation (run under no_grad)
            first = not recomputing()  # activation checkpointing re-runs this forward in backward
            if first:
                self._count(counts, keep)
            self._report_balance(logits, probs, counts, report=first)
        return Routing(experts, weights, keep)

    @torch.no_grad()
    def _count(self, counts: torch.Tensor, keep: torch.Tensor) -> None:
        if self.load.device != counts.device:
            self.load, self.drops = (
                torch.zeros_like(self.load, device=counts.device),
                torch.zeros(2, device=counts.device),
            )
        self.load += counts.to(self.load.dtype)
        self.drops[0] += (~keep).sum()
        self.drops[1] += keep.numel()

    def capacity(self, tokens: int) -> int:
        """Slots per expert per micro-batch: ceil(capacity_factor x tokens x k / E) (0: dropless)."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def _capacity(self, experts: torch.Tensor, weights: torch.Tensor, tokens: int) -> torch.Tensor:
        """Which (token, slot) assignments fit their expert's capacity: the highest weights win,
        compared at bf16 precision, and of equal ones the earlier token. Tokens with identical
        inputs (the first position of two sequences that start alike) have equal weights that
        fp32 GEMMs round a last bit apart depending on where the row falls in the kernel's
        blocking; compared in full, that bit chose the dropped slot differently per layout and CPU."""
        if self.capacity_factor <= 0:
            return torch.ones_like(experts, dtype=torch.bool)
        e, w = experts.flatten(), weights.detach().flatten().to(torch.bfloat16)
        by_score = torch.argsort(w, descending=True, stable=True)
        order = by_score[torch.argsort(e[by_score], stable=True)]  # by expert, best score first
        starts = torch.cumsum(torch.bincount(e, minlength=self.num_experts), 0) - torch.bincount(
            e, minlength=self.num_experts
        )
        rank = torch.arange(e.numel(), device=e.device) - starts[e[order]]
        keep = torch.empty_like(e, dtype=torch.bool)
        keep[order] = rank < self.capacity(tokens)
        return keep.view_as(experts)

    def _report_balance(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, report: bool) -> None:
        """The balance terms; computed on a recomputation too (checkpointing needs the same
        ops in the same order) but reported once."""
        if self.load_balance == "aux_loss" and self.aux_loss_coeff > 0:
            total = self.balance_counts(counts).float()
            f = total / total.sum()  # share of the micro-batch's routed slots per expert
            p = probs / probs.sum(-1, keepdim=True) if self.router_score == "sigmoid" else probs
            aux = self.num_experts * (f * p.mean(0)).sum()
            if report:
                report_aux(self, "aux_loss", self.aux_loss_coeff * aux)
        if self.z_loss_coeff > 0:
            z = torch.logsumexp(logits, -1).square().mean()
            if report:
                report_aux(self, "z_loss", self.z_loss_coeff * z)

    @torch.no_grad()
    def end_step(self, load: torch.Tensor, is_global: bool) -> None:
        """After an optimizer step: keep the step's load for metrics, move the balance bias by
        bias_update_rate x sign(mean load - load) (DeepSeek-V3), start counting afresh.
        ``load``: tokens per expert, summed over every data-parallel rank when ``is_global``
        (always so when balancing by bias)."""
        self.step_load, self.step_drops, self.step_load_global = load.clone(), self.drops.clone(), is_global
        if self.load_balance == "bias":
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load.zero_()
        self.drops.zero_()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE feed-forwards by block name (a pipeline rank sees its own blocks)."""
    return {name.split(".")[1]: m for name, m in model.named_modules() if isinstance(m, MoE)}


def end_step(model: nn.Module, sum_over_ranks: Callable[[torch.Tensor], None] | None = None) -> None:
    """Every MoE layer's ``end_step``. ``sum_over_ranks`` -- given by the run when other
    data-parallel ranks see other tokens -- sums the stacked loads across them in place; it
    is called only when some layer balances by bias (which needs the global load every
    step); otherwise the load stays local until metrics ask."""
    layers = list(moe_layers(model).values())
    if not layers:
        return
    loads = torch.stack([m.load for m in layers])
    summed = sum_over_ranks is not None and any(m.load_balance == "bias" for m in layers)
    if summed:
        sum_over_ranks(loads)
    for m, load in zip(layers, loads, strict=True):
        m.end_step(load, summed or sum_over_ranks is None)


def build_moe(shape: ShapeLike) -> MoE:
    """The MoE feed-forward for one block (called by the model's feed-forward factory)."""
    return MoE(copy.copy(shape))
