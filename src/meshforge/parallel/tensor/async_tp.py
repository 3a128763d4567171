"""Async tensor parallelism: sequence parallelism's collectives overlapped with the GEMMs beside them.

Under sequence parallelism a column-parallel layer needs the all-gather of the sequence shards
in front of it, and a row-parallel layer ends in a reduce-scatter. Run one after the other, the
GEMM waits for the whole collective and the collective for the whole GEMM. Decomposed into a
ring of tp point-to-point steps ("collective matmul", Wang et al. 2023), each step's transfer
runs while the GEMM works on the chunk that already arrived:

- all-gather + matmul (column layers; forward, and the backward of a row layer): the shard
  held is multiplied while it goes to the next rank and the next shard comes from the previous
  one; tp - 1 transfers, each beside one chunk's GEMM;
- matmul + reduce-scatter (row layers; forward, and the backward of a column layer): the
  partial output of the chunk that travels furthest is computed first and sent on; each rank
  adds its own partial of the next chunk to what arrives, and after tp - 1 steps holds its
  own chunk, summed. In the column layer's backward the weight gradient (no communication)
  runs beside the first transfer.

The same bytes move as with the collectives themselves ((tp-1)/tp of the full activation per
rank per collective, booked as all-gathers and reduce-scatters by comm_stats.book). The rows of a
decomposed GEMM are the same rows, so outputs match plain TP; sums over ranks and the row
layer's weight gradient (summed chunk by chunk) add in another order (within 1e-6 in fp32).

The ops are torch custom ops with their own autograd, so ``torch.compile`` keeps a block as one
graph (the ring runs eagerly inside the op) and selective recomputation can keep their outputs
(parallel/activation_checkpoint.py). ``transport = "symm_mem"`` (CUDA, where torch has them) runs
the same ops on torch's fused symmetric-memory kernels instead of the ring
(``compat.symm_mem_*``); under ``train.compile`` on CUDA meshforge keeps DTensor's plan and lets
inductor's micro-pipeline TP do it (parallel/tensor/apply.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshforge import compat
from meshforge.parallel import comm_stats
from meshforge.parallel.tensor.ring_pieces import pieces_of

_batch_isend_irecv = dist.batch_isend_irecv  # the original: the ring books its own bytes (comm_stats.book)


def _shift(send: Tensor, recv: Tensor, group: dist.ProcessGroup) -> list:
    """Start sending ``send`` to the next rank of the ring and receiving ``recv`` from the previous one."""
    n, r = group.size(), group.rank()
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(r + 1) % n),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(r - 1) % n),
    ]
    return _batch_isend_irecv(ops)


def _wait(works: list, group: dist.ProcessGroup) -> None:
    for w in works:
        comm_stats.wait(w, group)


def ring_gather(x: Tensor, group: dist.ProcessGroup, consume: Callable[[int, Tensor], None]) -> Tensor:
    """All-gather of ``x`` along dim 1 as a ring, each rank's chunk in k pieces;
    ``consume(piece index, piece)`` runs on each piece (in the gathered order's numbering, n·k
    in all) as soon as it is here, while later pieces travel. Returns the gathered tensor."""
    n, r, k = group.size(), group.rank(), pieces_of(x.shape[1])
    comm_stats.book("all_gather", x.numel() * x.element_size() * n, group)
    out: list[Tensor] = [x] * (n * k)
    cur = [t.contiguous() for t in x.chunk(k, 1)]
    works: list[list] = [[] for _ in range(k)]
    for step in range(n):
        src = (r - step) % n
        nxt: list[Tensor] = list(cur)
        for i in range(k):
            _wait(works[i], group)  # (piece i of this chunk has arrived)
            if step < n - 1:  # pass it on, take the next chunk's piece i
                nxt[i] = torch.empty_like(cur[i])
                works[i] = _shift(cur[i], nxt[i], group)
            consume(src * k + i, cur[i])
            out[src * k + i] = cur[i]
        cur = nxt
    return torch.cat(out, 1)


def ring_reduce_scatter(
    produce: Callable[[int, int], Tensor], group: dist.ProcessGroup, k: int, beside: Callable[[], None] | None = None
) -> Tensor:
    """Reduce-scatter along dim 1 of partial results ``produce(piece index, of n·k)`` as a ring,
    each chunk in k pieces: a piece is sent on as soon as it is summed, while the next ones are
    computed; ``beside`` runs once the first chunk's pieces are on their way. Returns this rank's
    chunk, summed over the ranks."""
    n, r = group.size(), group.rank()
    works: list[list] = [[] for _ in range(k)]
    recv: list[Tensor | None] = [None] * k
    mine: list[Tensor] = []
    for step in range(n):
        c = (r - 1 - step) % n
        for i in range(k):
            part = produce(c * k + i)
            if step == 0 and i == 0:
                comm_stats.book("reduce_scatter", part.numel() * part.element_size() * n * k, group)
            if step:
                _wait(works[i], group)
                part = part + recv[i]
            if step < n - 1:
                recv[i] = torch.empty_like(part)
                works[i] = _shift(part, recv[i], group)
            else:
                mine.append(part)
        if step == 0 and beside is not None:
            beside()
    return torch.cat(mine, 1)


def _chunk(t: Tensor, c: int, n: int) -> Tensor:
    """Positions c of n along dim 1, contiguous: a strided slice would run as a batched GEMM of
    each sequence's few rows (1.4x the time of one GEMM of them all, on a CPU)."""
    s = t.shape[1] // n
    return t[:, c * s : (c + 1) * s].contiguous()


def _dtype(name: str, like: Tensor) -> torch.dtype:
    return like.dtype if not name else getattr(torch, name)


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("meshforge::all_gather_matmul", mutates_args=())
def all_gather_matmul(x: Tensor, weights: list[Tensor], group_name: str, dtype: str, transport: str) -> list[Tensor]:
    """``[gathered x, x_full @ w.T for each w]``: x (b, s/tp, h) this rank's sequence shard,
    gathered over tp along dim 1 while multiplying; ``dtype`` the GEMMs' ('': x's)."""
    group, dt = compat.resolve_group(group_name), _dtype(dtype, x)
    ws = [w.to(dt) for w in weights]
    if transport == "symm_mem":
        gathered, outs = compat.symm_mem_all_gather_matmul(x.to(dt), [w.t() for w in ws], 1, group_name)
        return [gathered.to(x.dtype), *outs]
    nk = group.size() * pieces_of(x.shape[1])
    parts: list[list[Tensor]] = [[x] * nk for _ in ws]

    def consume(c: int, chunk: Tensor) -> None:
        for i, w in enumerate(ws):
            parts[i][c] = F.linear(chunk.to(dt), w)

    with torch.autocast(x.device.type, enabled=False):
        gathered = ring_gather(x, group, consume)
        return [gathered, *(torch.cat(p, 1) for p in parts)]


@all_gather_matmul.register_fake
def _(x: Tensor, weights: list[Tensor], group_name: str, dtype: str, transport: str) -> list[Tensor]:
    b, s, h = x.shape
    n = compat.resolve_group(group_name).size()
    return [x.new_empty(b, s * n, h), *(x.new_empty(b, s * n, w.shape[0], dtype=_dtype(dtype, x)) for w in weights)]


@torch.library.custom_op("meshforge::all_gather_matmul_backward", mutates_args=())
def all_gather_matmul_backward(
    grads: list[Tensor], weights: list[Tensor], gathered: Tensor, group_name: str, dtype: str, transport: str
) -> list[Tensor]:
    """``[dx, dw for each w]``: the input gradient summed over the weights, reduce-scattered over
    tp while the next chunk's partial is computed, the weight gradients beside the first transfer."""
    group, dt = compat.resolve_group(group_name), _dtype(dtype, gathered)
    ws, gs = [w.to(dt) for w in weights], [g.to(dt) for g in grads]
    dws: list[Tensor] = []

    def weight_grads() -> None:
        x2 = gathered.to(dt).flatten(0, 1)
        dws.extend((g.flatten(0, 1).t() @ x2).to(w.dtype) for g, w in zip(gs, weights, strict=True))

    with torch.autocast(gathered.device.type, enabled=False):
        if transport == "symm_mem":
            weight_grads()
            g_cat, w_cat = torch.cat(gs, -1), torch.cat(ws, 0)
            dx = compat.symm_mem_matmul_reduce_scatter(g_cat, w_cat, 1, group_name)
            return [dx.to(gathered.dtype), *dws]
        n = group.size()
        nk = n * pieces_of(gathered.shape[1] // n)

        def produce(c: int) -> Tensor:
            return sum((_chunk(g, c, nk) @ w).to(gathered.dtype) for g, w in zip(gs, ws, strict=True))

        dx = ring_reduce_scatter(produce, group, nk // n, beside=weight_grads)
        if not dws:  # (one rank: no transfer to run beside)
            weight_grads()
        return [dx, *dws]


@all_gather_matmul_backward.register_fake
def _(grads: list[Tensor], weights: list[Tensor], gathered: Tensor, group_name: str, dtype: str, transport: str):
    n = compat.resolve_group(group_name).size()
    b, s, h = gathered.shape
    return [gathered.new_empty(b, s // n, h), *(torch.empty_like(w) for w in weights)]


def _ag_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weights, group_name, dtype, transport = inputs
    ctx.save_for_backward(output[0], *weights)
    ctx.args = (group_name, dtype, transport)


def _ag_backward(ctx, grads):  # noqa: ANN001, ANN202
    gathered, *weights = ctx.saved_tensors
    grads = [g if g is not None else torch.zeros((), dtype=gathered.dtype) for g in grads[1:]]
    grads = [g.expand(*gathered.shape[:2], w.shape[0]).contiguous() for g, w in zip(grads, weights, strict=True)]
    dx, *dws = all_gather_matmul_backward(grads, weights, gathered, *ctx.args)
    return dx, dws, None, None, None


all_gather_matmul.register_autograd(_ag_backward, setup_context=_ag_setup)


@torch.library.custom_op("meshforge::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(y: Tensor, weight: Tensor, group_name: str, dtype: str, transport: str) -> Tensor:
    """``y @ weight.T`` (y (b, s, k/tp) full sequence, column-sharded features) summed over tp,
    each rank keeping its sequence chunk (b, s/tp, h), reduced while the next chunk is multiplied."""
    group, dt = compat.resolve_group(group_name), _dtype(dtype, y)
    w = weight.to(dt)
    with torch.autocast(y.device.type, enabled=False):
        if transport == "symm_mem":
            return compat.symm_mem_matmul_reduce_scatter(y.to(dt), w.t(), 1, group_name)
        k = pieces_of(y.shape[1] // group.size())
        nk = group.size() * k
        return ring_reduce_scatter(lambda c: F.linear(_chunk(y, c, nk).to(dt), w), group, k)


@matmul_reduce_scatter.register_fake
def _(y: Tensor, weight: Tensor, group_name: str, dtype: str, transport: str) -> Tensor:
    n = compat.resolve_group(group_name).size()
    return y.new_empty(y.shape[0], y.shape[1] // n, weight.shape[0], dtype=_dtype(dtype, y))


@torch.library.custom_op("meshforge::matmul_reduce_scatter_backward", mutates_args=())
def matmul_reduce_scatter_backward(
    grad: Tensor, y: Tensor, weight: Tensor, group_name: str, dtype: str, transport: str
) -> list[Tensor]:
    """``[dy, dweight]``: the output gradient's chunks all-gathered over tp as a ring, each
    multiplied (input gradient rows, and its share of the weight gradient) while the next travels."""
    group, dt = compat.resolve_group(group_name), _dtype(dtype, y)
    w, nk = weight.to(dt), group.size() * pieces_of(grad.shape[1])
    with torch.autocast(y.device.type, enabled=False):
        if transport == "symm_mem":
            full, (dy,) = compat.symm_mem_all_gather_matmul(grad.to(dt), [w], 1, group_name)
            dw = full.flatten(0, 1).t() @ y.to(dt).flatten(0, 1)
            return [dy.to(y.dtype), dw.to(weight.dtype)]
        dys: list[Tensor] = [y] * nk
        dw = torch.zeros_like(w)

        def consume(c: int, chunk: Tensor) -> None:
            g = chunk.to(dt)
            dys[c] = (g @ w).to(y.dtype)
            dw.addmm_(g.flatten(0, 1).t(), _chunk(y, c, nk).to(dt).flatten(0, 1))  # (summed in the GEMM)

        ring_gather(grad, group, consume)
        return [torch.cat(dys, 1), dw.to(weight.dtype)]


@matmul_reduce_scatter_backward.register_fake
def _(grad: Tensor, y: Tensor, weight: Tensor, group_name: str, dtype: str, transport: str) -> list[Tensor]:
    return [torch.empty_like(y), torch.empty_like(weight)]


def _rs_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    y, weight, group_name, dtype, transport = inputs
    ctx.save_for_backward(y, weight)
    ctx.args = (group_name, dtype, transport)


def _rs_backward(ctx, grad):  # noqa: ANN001, ANN202
    y, weight = ctx.saved_tensors
    dy, dw = matmul_reduce_scatter_backward(grad.contiguous(), y, weight, *ctx.args)
    return dy, dw, None, None, None


matmul_reduce_scatter.register_autograd(_rs_backward, setup_context=_rs_setup)


# ----------------------------------------------------------------------------- the seams


def _local(w: Tensor) -> Tensor:
    """A tp-sharded weight's local shard (differentiable; its gradient becomes the DTensor's)."""
    return w.to_local() if isinstance(w, DTensor) else w


def compute_dtype(x: Tensor) -> str:
    """The GEMMs' dtype: autocast's where it is on (the ops turn it off inside), else '' (the inputs')."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
    return ""


class AllGatherMatmul(nn.Module):
    """The projections in front of attention or the MLP (the model's ``project_in`` seam) under
    async TP: the sequence shard is gathered over tp once, for all of them, while multiplying."""

    def __init__(self, group: dist.ProcessGroup, transport: str = "ring"):
        super().__init__()
        self.group_name, self.transport = group.group_name, transport

    def forward(self, x: Tensor, linears: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
        weights = [_local(lin.weight) for lin in linears]
        _, *outs = all_gather_matmul(x, weights, self.group_name, compute_dtype(x), self.transport)
        return tuple(outs)


class MatmulReduceScatter(nn.Module):
    """The output projection of attention or the MLP (the model's ``project_out`` seam) under
    async TP: multiplied and reduce-scattered over tp chunk by chunk."""

    def __init__(self, group: dist.ProcessGroup, transport: str = "ring"):
        super().__init__()
        self.group_name, self.transport = group.group_name, transport

    def forward(self, y: Tensor, linear: nn.Module) -> Tensor:
        return matmul_reduce_scatter(y, _local(linear.weight), self.group_name, compute_dtype(y), self.transport)


class AllGatherMatmulHead(nn.Module):
    """The head (the model's ``Head.project`` seam) under async TP: the final norm's sequence
    shards gathered over tp while the vocab-sharded logits are multiplied; the logits leave as
    the vocab-sharded DTensor the loss-parallel cross-entropy reads, as the plain plan's do."""

    def __init__(self, mesh: DeviceMesh, transport: str = "ring"):
        super().__init__()
        self.mesh, self.group_name, self.transport = mesh, mesh.get_group().group_name, transport

    def forward(self, x: Tensor, head: nn.Linear) -> Tensor:
        local = x.to_local() if isinstance(x, DTensor) else x  # (its gradient leaves sequence-sharded)
        w = [_local(head.weight)]
        _, logits = all_gather_matmul(local, w, self.group_name, compute_dtype(local), self.transport)
        return DTensor.from_local(logits, self.mesh, [Shard(-1)], run_check=False)
