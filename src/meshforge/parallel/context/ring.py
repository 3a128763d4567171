"""Context parallelism: each ``cp`` rank holds a slice of every sequence, and attention runs
over a ring of key/value blocks (Liu et al. 2023, "Ring Attention"), exact, on any device.

Sharding. With ``parallel.cp_balance = "zigzag"`` each sequence is cut into 2·cp chunks and
rank r holds chunks r and 2·cp-1-r, so under the causal mask every rank does the same
attention work (a contiguous split leaves the last rank with cp times the first's).
``"none"`` gives rank r the r-th contiguous 1/cp. Inputs, targets and positions are taken
with the same index (``shard_index``), so RoPE sees each token's true position.

Attention. Queries stay put; key/value blocks travel. For each (query chunk, key chunk)
pair the mask is known from the chunk ids alone: a later query chunk sees the whole key
chunk, the same chunk sees its causal triangle, an earlier one sees nothing (skipped).
Partial outputs are merged by their log-sum-exp in fp32. The backward is its own pass
(``RingAttentionFn``): it recomputes each block's probabilities from the saved lse, and
the key/value gradients travel the ring with their block, arriving back at their owner
after cp hops. Each hop is started before the block in hand is attended (forward and
backward) and the key/value gradients' sum is passed on while the next block is computed, so
the transfers run beside the attention kernels (issue 42; bench/bench_overlap.py's cp row).
``parallel.cp_rotate = "allgather"`` gathers all blocks once instead and
all-reduces the key/value gradients (simpler, cp times the memory for K/V).

Each block runs on a fused kernel that returns its log-sum-exp (``attention_kernels``: the
CPU flash op, CUDA flash / memory-efficient), falling back to an fp32 math implementation.
PyTorch's own context-parallel attention (torch.distributed.tensor.experimental) has no
sharding rule for the CPU op, so it does not run on gloo; this one runs everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config.layout import Layout
from meshforge.models.documents import Documents
from meshforge.parallel import comm_stats
from meshforge.parallel.context.document_ring import BlockWork, RingPlan, plan_ring
from meshforge.parallel.context.kernels import block_backward, block_forward, pick_kernel
from meshforge.parallel.mesh import Mesh


def chunk_ids(cp: int, rank: int, balance: str) -> tuple[int, ...]:
    """The sequence chunks cp rank ``rank`` holds, in order (out of 2·cp for zigzag, cp for none)."""
    return (rank, 2 * cp - 1 - rank) if balance == "zigzag" else (rank,)


def shard_index(seq_len: int, cp: int, rank: int, balance: str, device: torch.device | None = None) -> torch.Tensor:
    """The positions of this rank's tokens in a sequence of ``seq_len``: the index for its
    inputs, targets and RoPE positions."""
    n = 2 * cp if balance == "zigzag" else cp
    size = seq_len // n
    parts = [torch.arange(c * size, (c + 1) * size, device=device) for c in chunk_ids(cp, rank, balance)]
    return torch.cat(parts)


@dataclass(frozen=True)
class Ring:
    """Where a rank sits in the cp group and how blocks move."""

    group: dist.ProcessGroup | None
    rank: int
    cp: int
    balance: str = "zigzag"
    rotate: str = "ring"
    kernel: str = "auto"  # attention_kernels.KERNELS: "math" forces the fallback (tests compare the two)

    def ids(self, rank: int) -> tuple[int, ...]:
        return chunk_ids(self.cp, rank, self.balance)

    def start_shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """Start sending each tensor to the next rank and receiving the previous rank's (one
        batched exchange): (the receive buffers, the requests to ``finish``). Every rank starts
        its exchanges in the same order, so they pair up whatever else is in flight."""
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.cp)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.cp)
        tensors = [t.contiguous() for t in tensors]  # (k, v arrive as transposed views)
        out = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, o, prv, self.group) for o in out]
        return out, [*dist.batch_isend_irecv(ops), tensors]  # (the sends' tensors kept alive)

    def finish(self, started: tuple[list[torch.Tensor], list[Any]]) -> list[torch.Tensor]:
        """Wait for an exchange ``start_shift`` began; the received tensors."""
        out, reqs = started
        for req in reqs[:-1]:
            comm_stats.wait(req, self.group)
        return out

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t``, indexed by cp rank."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.cp)]
        dist.all_gather(out, t, group=self.group)
        return out


def _split(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(t.chunk(n, dim=2))


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, bo: torch.Tensor, bl: torch.Tensor) -> tuple:
    if out is None:
        return bo, bl
    new = torch.logaddexp(lse, bl)
    return out * torch.exp(lse - new).unsqueeze(-1) + bo * torch.exp(bl - new).unsqueeze(-1), new


def _merge_rows(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    bo: torch.Tensor,
    bl: torch.Tensor,
    work: BlockWork,
    shape: tuple,
) -> tuple:
    """Merge a block run on ``work.rows`` into the running (out, lse) of all rows; queries that
    have seen no key yet hold lse -inf and a zero output (packed documents)."""
    if work.empty is not None:
        bl, bo = bl.masked_fill(work.empty, float("-inf")), bo.masked_fill(work.empty.unsqueeze(-1), 0.0)
    if out is None:
        out, lse = bo.new_zeros(shape), bl.new_full(shape[:-1], float("-inf"))
    r = work.rows
    o, ls = (out, lse) if r is None else (out[r], lse[r])
    new = torch.logaddexp(ls, bl)
    safe = new.masked_fill(torch.isneginf(new), 0.0)  # both -inf: nothing seen yet, weights 0
    merged = o * torch.exp(ls - safe).unsqueeze(-1) + bo * torch.exp(bl - safe).unsqueeze(-1)
    if r is None:
        return merged, new
    return out.index_copy(0, r, merged), lse.index_copy(0, r, new)


def _doc_forward(work: BlockWork, q, k, v, out, lse, scale: float, kernel: str) -> tuple:
    """One block of the ring over packed documents: on its rows, masked where it must be."""
    shape = (*q.shape[:-1], v.shape[-1])
    if work.rows is not None:
        q, k, v = q[work.rows], k[work.rows], v[work.rows]
    bias = None if work.mask is None else work.additive_mask(q.dtype)
    bo, bl, aux = block_forward(q, k, v, work.causal, scale, kernel, bias)
    return (*_merge_rows(out, lse, bo, bl, work, shape), aux)


def _doc_backward(work: BlockWork, grads: tuple, dout, q, k, v, out, lse, scale: float, kernel: str, aux) -> None:
    """Add one block's dq, dk, dv (over packed documents) into ``grads``' (dq, dk, dv) chunks."""
    r = work.rows
    if r is not None:
        dout, q, k, v, out, lse = (t[r] for t in (dout, q, k, v, out, lse))
    bias = None if work.mask is None else work.additive_mask(q.dtype)
    got = block_backward(dout, q, k, v, out, lse, work.causal, scale, kernel, aux, bias)
    for acc, g in zip(grads, got, strict=True):
        if r is None:
            acc.add_(g)
        else:
            acc.index_add_(0, r, g.to(acc.dtype))


def _pairs(ring: Ring, src: int) -> list[tuple[int, int, bool]]:
    """(local query chunk, source key chunk, causal) for every pair that is not masked out."""
    out = []
    for i, a in enumerate(ring.ids(ring.rank)):
        for j, b in enumerate(ring.ids(src)):
            if a >= b:
                out.append((i, j, a == b))
    return out


def _blocks(ring: Ring, k: torch.Tensor, v: torch.Tensor) -> Any:
    """Yield (source rank, its k, its v) for every cp rank: over the ring, or from one all-gather."""
    if ring.rotate == "allgather":
        kv = ring.gather(torch.stack([k, v]))
        for src in range(ring.cp):
            yield src, kv[src][0], kv[src][1]
        return
    for step in range(ring.cp):  # the next block travels while this one is attended
        nxt = ring.start_shift([k, v]) if step < ring.cp - 1 else None
        yield (ring.rank - step) % ring.cp, k, v
        if nxt is not None:
            k, v = ring.finish(nxt)


class RingAttentionFn(torch.autograd.Function):
    """Causal attention of local q (b, h, s_local, d) over every rank's k, v (b, h_kv, s_local, d)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, plan: RingPlan | None = None
    ) -> torch.Tensor:
        """``plan``: packed documents (``parallel/context/document_ring.py``): skip and mask blocks as it says."""
        n, scale = len(ring.ids(ring.rank)), 1.0 / math.sqrt(q.shape[-1])
        kernel = pick_kernel(q, ring.kernel)
        qs = _split(q, n)
        outs: list[Any] = [None] * n
        lses: list[Any] = [None] * n
        aux = None  # a CUDA kernel's extra backward inputs (every block has the same shape)
        for src, kb, vb in _blocks(ring, k, v):
            ks, vs = _split(kb, n), _split(vb, n)
            for i, j, causal in _pairs(ring, src):
                if plan is None:
                    bo, bl, aux = block_forward(qs[i], ks[j], vs[j], causal, scale, kernel)
                    outs[i], lses[i] = _merge(outs[i], lses[i], bo, bl)
                elif (work := plan.blocks[(src, i, j)]) is not None:  # None: skipped
                    outs[i], lses[i], got = _doc_forward(work, qs[i], ks[j], vs[j], outs[i], lses[i], scale, kernel)
                    aux = got if got is not None else aux
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel, ctx.aux, ctx.plan = ring, kernel, aux, plan
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        n, scale = len(ring.ids(ring.rank)), 1.0 / math.sqrt(q.shape[-1])
        qs, dos, outs, ls = _split(q, n), _split(dout, n), _split(out, n), _split(lse, n)
        acc = out.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dqs = _split(dq, n)
        grads = []  # allgather: every source's (dk, dv); ring: the running sum travelling with the block
        passing = None  # ring: the sum on its way to the next rank while the next block is computed
        for src, kb, vb in _blocks(ring, k, v):
            ks, vs = _split(kb, n), _split(vb, n)
            dkv = torch.zeros((2, *kb.shape), dtype=acc, device=q.device)
            dks, dvs = _split(dkv[0], n), _split(dkv[1], n)
            for i, j, causal in _pairs(ring, src):
                if ctx.plan is not None:
                    if (work := ctx.plan.blocks[(src, i, j)]) is not None:
                        at = (dos[i], qs[i], ks[j], vs[j], outs[i], ls[i])
                        _doc_backward(work, (dqs[i], dks[j], dvs[j]), *at, scale, ctx.kernel, ctx.aux)
                    continue
                gq, gk, gv = block_backward(
                    dos[i], qs[i], ks[j], vs[j], outs[i], ls[i], causal, scale, ctx.kernel, ctx.aux
                )
                dqs[i].add_(gq)
                dks[j].add_(gk)
                dvs[j].add_(gv)
            if ring.rotate == "allgather":
                grads.append(dkv)
            else:  # add this rank's part and pass the sum on: after cp hops it is back at its owner
                grads = ring.finish(passing) if passing is not None else []
                passing = ring.start_shift([dkv + grads[0] if grads else dkv])
        if passing is not None:
            grads = ring.finish(passing)
        if ring.rotate == "allgather":  # sum every rank's contributions, keep this rank's block
            full = torch.stack(grads)
            dist.all_reduce(full, group=ring.group)
            grads = [full[ring.rank]]
        dkv = grads[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


class RingAttention(nn.Module):
    """Drop-in for the model's attention core (``block.attention.core``) on a cp group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        cp_rank: int,
        cp: int,
        balance: str = "zigzag",
        rotate: str = "ring",
        kernel: str = "auto",
    ):
        super().__init__()
        self.ring = Ring(group, cp_rank, cp, balance, rotate, kernel)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """``documents``: the whole sequences' packed documents (every cp rank gets all of them)."""
        if documents is None or documents.single:
            return RingAttentionFn.apply(q, k, v, self.ring, None)
        documents.check_rows(q.shape[0])
        return RingAttentionFn.apply(q, k, v, self.ring, self.plan(documents))

    def plan(self, documents: Documents) -> RingPlan:
        """This rank's ring plan for ``documents`` (built once per micro-batch, then cached on them)."""
        r = self.ring
        n = 2 * r.cp if r.balance == "zigzag" else r.cp
        return documents.cached(("ring", r.cp, r.rank, r.balance), lambda: plan_ring(documents, r.ids, r.rank, r.cp, n))


def apply_cp(model: nn.Module, mesh: Mesh, lay: Layout) -> None:
    """Swap every block's attention core for ring attention over the ``cp`` mesh dimension."""
    for block in model.layers.values():
        block.attention.core = RingAttention(
            mesh.group("cp"), mesh.coordinate("cp"), lay.cp, lay.cp_balance, lay.cp_rotate
        )


def cp_index(seq_len: int, mesh: Mesh, lay: Layout) -> torch.Tensor | None:
    """This rank's token index into each sequence (None without context parallelism)."""
    if lay.cp == 1:
        return None
    return shard_index(seq_len, lay.cp, mesh.coordinate("cp"), lay.cp_balance, mesh.device)
