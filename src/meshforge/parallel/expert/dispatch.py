"""Expert parallelism: each MoE layer's experts split over ``ep`` data-parallel ranks.

Rank r of an ep group holds experts [r·E/ep, (r+1)·E/ep) (the stacked weights become
DTensors sharded on dim 0 over the expert mesh's ``ep`` dimension, so checkpoints and
exports still see the full [E, ...] tensors). Each rank routes its own tokens as on one
device; the model's ``MoE.dispatcher`` seam is swapped for ``AllToAllDispatch``:

1. exchange per-expert token counts (an all-gather of E numbers per rank),
2. send each token to the rank holding its expert (a variable-split ``all_to_all_single``),
3. regroup the received tokens by local expert and run the local grouped GEMM,
4. send the outputs back with the reverse all-to-all (the origin weights and sums them).

Both all-to-alls are differentiable (the backward of one is the other with the splits
swapped). Per MoE layer and rank the token all-to-alls move 2 x tokens x k x hidden x
bytes x (ep-1)/ep in the forward pass and as much in the backward (``a2a_bytes_formula``).

Gradient scaling: the expert weights are sharded by FSDP over ``edp`` (the ranks holding
the same experts). A rank's expert gradient already sums the contributions of every token
its ep group routed to it (each token's loss scaled by its own rank's 1/tokens), and FSDP
averages over edp, so the single-process gradient -- the mean over all dp_shard x cp =
edp x ep ranks -- needs a further 1/ep. The dispatcher puts it into the backward pass:
the gradient entering the experts is scaled by 1/ep and the gradient leaving them for the
tokens by ep, which leaves the token gradients exact and the weight gradients x 1/ep
(an FSDP gradient divide factor would do the same, but its PREMUL_SUM reduction does not
exist on gloo). Under tp the experts are replicated over tp and each tp rank runs them on
its share of the slots (parallel/tensor/moe.py): their gradients are summed over
tp after FSDP's reduce-scatter. Under HSDP FSDP also averages them over dp_replicate.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from meshforge.compat import all_gather_flat
from meshforge.config.layout import Layout
from meshforge.models.eager import eager_only
from meshforge.models.moe import GroupedExperts, is_moe_layer, moe_layers
from meshforge.parallel.data.apply import AllReduceScatter
from meshforge.parallel.expert import overlap
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.tensor.moe import share_rows, sum_over_tp


class _AllToAll(torch.autograd.Function):
    """Variable-split all_to_all_single of rows; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(grad, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.scale, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable: send ``in_splits[d]`` rows of ``x`` to rank d, receive ``out_splits[s]`` from rank s."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatch(nn.Module):
    """The MoE dispatcher under ep: tokens sorted by (global) expert in, their experts' outputs out;
    with ``chunks`` > 1 the all-to-alls overlap the experts' compute (parallel/expert/overlap.py)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, chunks: int = 1):
        super().__init__()
        self.group, self.ep, self.chunks = group, ep, chunks
        self.rank = dist.get_rank(group)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        e = counts.numel()
        self.elem_bytes = x.element_size()  # for the logged formula (train/moe_stats.py)
        gathered = counts.new_empty(self.ep * e)
        all_gather_flat(gathered, counts, group=self.group)
        table = gathered.view(self.ep, self.ep, e // self.ep)  # [source][destination][local expert]
        if self.chunks > 1:
            run = getattr(experts, "dispatched", None)  # one FSDP call around the pipeline (overlap.register)
            return run(self._pipelined, x, table, experts) if run else self._pipelined(x, table, experts)
        rows = table.tolist()
        send = [sum(c) for c in rows[self.rank]]
        recv = [sum(rows[s][self.rank]) for s in range(self.ep)]
        received = all_to_all(x, recv, send, self.group)
        return all_to_all(self._experts(received, rows, experts), send, recv, self.group)

    def _experts(self, received: torch.Tensor, rows: list, call: Any) -> torch.Tensor:
        """The local experts on received rows (by source, then local expert): grouped by
        expert, scaled for the gradient (module docstring), and back in arrival order."""
        order, local_counts = _by_local_expert([rows[s][self.rank] for s in range(self.ep)], received.device)
        inputs = _ScaleGrad.apply(received[order], float(self.ep))
        return _ScaleGrad.apply(call(inputs, local_counts), 1.0 / self.ep)[torch.argsort(order)]

    @eager_only  # the pipeline waits on handles between its GEMMs: it runs eagerly
    def _pipelined(self, x: torch.Tensor, table: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """Chunk by chunk: dispatch j+1 and combine j-1 travel while chunk j's experts compute."""
        me, link = self.rank, overlap.Link(self.group)
        shares = [overlap.chunk_table(table, j, self.chunks).tolist() for j in range(self.chunks)]
        mine = [share_rows(table[me].flatten(), j, self.chunks)[0] for j in range(self.chunks)]
        send = [[sum(c) for c in t[me]] for t in shares]
        recv = [[sum(t[s][me]) for s in range(self.ep)] for t in shares]
        compute = functools.partial(overlap.run_experts, experts)
        got, d = overlap.start(link, x[mine[0]], send[0], recv[0])
        combines = []
        for j in range(self.chunks):
            arrived = overlap.finish(got, d)
            if j + 1 < self.chunks:
                got, d = overlap.start(link, x[mine[j + 1]], send[j + 1], recv[j + 1])
            y = self._experts(arrived, shares[j], compute)
            combines.append(overlap.start(link, y, recv[j], send[j]))
        out = torch.cat([overlap.finish(o, t) for o, t in combines])
        return out[torch.argsort(torch.cat(mine))]


def _by_local_expert(arrived: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come by source rank, then local expert (``arrived[source][expert]``
    rows each); the order that groups them by local expert (source-major inside), and the
    per-local-expert counts."""
    table = torch.tensor(arrived, dtype=torch.long, device=device)
    experts = torch.arange(table.shape[1], device=device).repeat(table.shape[0])
    order = torch.argsort(experts.repeat_interleave(table.flatten()), stable=True)
    return order, table.sum(0)


def apply_ep(model: nn.Module, mesh: Mesh, lay: Layout) -> None:
    """Split every MoE layer's experts over the ep ranks (the model is still on the meta
    device: only the shapes change) and swap its dispatcher for the all-to-all one."""
    assert mesh.expert_mesh is not None, "ep > 1 builds the expert mesh (parallel/mesh.py)"
    ep_mesh = mesh.expert_mesh["ep"]
    for moe in moe_layers(model).values():
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)])))
        moe.dispatcher = AllToAllDispatch(mesh.ep_group, lay.ep, lay.ep_chunks)


def shard_experts(model: nn.Module, mesh: Mesh, lay: Layout, param_dtype: torch.dtype | None) -> None:
    """FSDP over edp for every MoE layer's experts (before the blocks are wrapped, so the
    blocks leave them alone); it averages their gradients over edp (the dispatcher adds the 1/ep).
    HSDP (dp_replicate > 1): sharded over edp, replicated and averaged over dp_replicate too.
    tp > 1: the tp ranks ran the experts on other slots, so their gradients are summed over tp."""
    hsdp = lay.dp_replicate > 1
    fsdp_mesh = mesh.expert_mesh[("dp_replicate", "edp")] if hsdp else mesh.expert_mesh["edp"]
    # the MoE layer never changes the experts' output in place, which is what FSDP2's warning is about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGroupedExperts\) returned a view")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for moe in moe_layers(model).values():
        unit = fully_shard(moe.experts, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=lay.zero_stage == 3)
        if dist.get_backend(fsdp_mesh.get_group("edp")) == "gloo":
            unit.set_custom_reduce_scatter(AllReduceScatter())
        if lay.tp > 1:
            unit.set_all_reduce_hook(sum_over_tp(mesh.group("tp")))
        if lay.ep_chunks > 1:
            overlap.register(moe.experts)


def a2a_bytes_formula(args: Any, tokens: int, elem_bytes: int, ep: int) -> float:
    """Token all-to-all bytes per rank and step (forward + backward, every MoE layer) for
    ``tokens`` tokens on this rank: 2 exchanges x tokens x k x hidden x bytes x (ep-1)/ep per
    layer and pass. Dropless and averaged over the ep ranks, this is what is measured."""
    layers = sum(1 for i in range(args.layers) if is_moe_layer(args, i))
    return 2 * 2 * tokens * args.experts_per_token * args.hidden * elem_bytes * (ep - 1) / ep * layers
