"""Output head + cross-entropy over token chunks, without the full logits.

The plain path materialises ``tokens x vocab`` logits, an fp32 copy and its gradient: at
seq 32768 and a 128K vocabulary that is 15.7 GiB per copy. Here the head's matmul, the fp32
log-softmax and both gradients are computed one chunk of tokens at a time, so at most one
chunk's logits are alive. Like Liger-Kernel's fused linear cross-entropy the gradients are
computed in the forward (the backward only scales them by the incoming gradient), which
costs no extra matmul: three per chunk, the same as the plain forward + backward.

Under tensor parallelism the head weight is a vocab-sharded DTensor: each rank computes
its vocabulary's logits and the log-sum-exp and the target's logit are completed with
three small all-reduces over the weight's mesh per chunk (max, sum of exponentials,
target logit); the hidden states' gradient is a partial sum that DTensor reduces (a
reduce-scatter under sequence parallelism). The loop has no data-dependent control flow.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from meshforge.models.eager import eager_only

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it count for nothing


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_loss(x, wc, t, cdt, group, vocab_start: int, need_grad: bool):
    """Summed loss of one chunk, and (need_grad) d loss / d logits in ``cdt`` (None otherwise)."""
    logits = (x.to(cdt) @ wc.T).float()  # (c, local vocab): the only logits alive
    n_local = logits.shape[1]
    local_t = t - vocab_start
    valid = t != IGNORE_INDEX
    mine = (local_t >= 0) & (local_t < n_local) & valid  # the target's logit lives on this rank
    safe = local_t.clamp(0, n_local - 1).unsqueeze(1)
    target_logit = _all_reduce(logits.gather(1, safe).squeeze(1) * mine, dist.ReduceOp.SUM, group)
    m = _all_reduce(logits.amax(1), dist.ReduceOp.MAX, group)
    e = logits.sub_(m.unsqueeze(1)).exp_()  # in place: still one chunk
    s = _all_reduce(e.sum(1), dist.ReduceOp.SUM, group)
    loss = ((m + s.log() - target_logit) * valid).sum()
    if not need_grad:
        return loss, None
    p = e.div_(s.unsqueeze(1))  # softmax
    p.scatter_add_(1, safe, -mine.unsqueeze(1).to(p.dtype))  # minus the one-hot target
    return loss, p.mul_(valid.unsqueeze(1)).to(cdt)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``x @ w.T`` against ``targets``; gradients computed in forward."""

    @staticmethod
    def forward(ctx, x, w, targets, chunk, cdt, group, vocab_start, need_grad, fused):  # noqa: ANN001, ANN205
        chunk_loss = _fused_chunk_loss() if fused and group is None else _chunk_loss
        wc = w.to(cdt)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        for start in range(0, x.shape[0], chunk):
            xs, ts = x[start : start + chunk], targets[start : start + chunk]
            part, g = chunk_loss(xs, wc, ts, cdt, group, vocab_start, need_grad)
            loss = loss + part
            if need_grad:
                grad_x[start : start + chunk] = g @ wc
                if cdt == grad_w.dtype:  # fp32: accumulate in place, no (vocab, hidden) temporary
                    grad_w.addmm_(g.T, xs.to(cdt))
                else:
                    grad_w.add_(g.T @ xs.to(cdt))
            del g  # before the next chunk's logits: one chunk alive at a time
        ctx.save_for_backward(*(t for t in (grad_x, grad_w) if t is not None))
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        grad_x, grad_w = ctx.saved_tensors
        return (
            grad_x * grad_out.to(grad_x.dtype),
            (grad_w * grad_out).to(ctx.w_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


@functools.cache
def _fused_chunk_loss():  # noqa: ANN202
    """One chunk's math compiled on its own: a forward-only graph (the Function's forward runs
    without autograd), so its upcast, log-softmax and gradient fuse and nothing is saved."""
    return torch.compile(_chunk_loss, dynamic=False)


@eager_only
def _apply_outside_graphs(*args):  # noqa: ANN002, ANN202
    """The chunk loop runs outside any compiled graph around it (a deliberate graph break).
    Traced into the loss's graph, AOT autograd's partitioner kept every chunk's tokens x vocab
    gradient for backward — 2 bytes per vocabulary entry and token in bf16, the full logits the
    chunking exists to avoid (measured by calibration/activation_probe.py) — where this Function
    keeps only the hidden states' and the head's gradients. ``fused`` compiles each chunk instead."""
    return _ChunkedHeadCrossEntropy.apply(*args)


def _local_head(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dist.ProcessGroup | None, int]:
    """Plain tensors pass through; a vocab-sharded DTensor head gives its local rows, its
    mesh's group and its first vocabulary id (the hidden states' gradient is a partial sum).
    DTensor is imported here, not with the module: the planner (every launcher's pre-flight)
    imports the models, and DTensor costs ~1.2 s of CPU to import."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(w, DTensor):
        return x, w, None, 0
    if w.device_mesh.ndim != 1 or tuple(w.placements) != (Shard(0),):
        raise ValueError(f"chunked loss: the head weight must be vocab-sharded on one mesh dim, got {w.placements}")
    if isinstance(x, DTensor) and x.device_mesh == w.device_mesh and tuple(x.placements) == (Shard(1),):
        x = x.redistribute(placements=[Replicate()])  # async TP's head leaves its input sequence-sharded
    if not isinstance(x, DTensor) or tuple(x.placements) != (Replicate(),):  # e.g. an ungathered FSDP shard
        raise ValueError(
            f"chunked loss: the head weight is a DTensor ({w.placements}) but the hidden states are not replicated "
            "DTensors (the head's tp plan makes them so): the head was called outside its hooks; set "
            "train.loss_chunk_size = 0"
        )
    start = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)[1][0]
    # the gradient is a partial sum over the vocab shards; the head's input plan reduces it (a
    # reduce-scatter under sequence parallelism), so no redistribute here, which would all-reduce it
    x = x.to_local(grad_placements=[Partial()])
    return x, w.to_local(), w.device_mesh.get_group(), int(start)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    reduction: str = "mean",
    compute_dtype: torch.dtype | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets, reduction=reduction)`` (mean over
    the targets that are not IGNORE_INDEX, or their sum), ``chunk`` tokens at a time.

    ``hidden`` (..., H) and ``targets`` (...) are flattened; the logits' matmul runs in
    ``compute_dtype`` (default: ``hidden``'s dtype), the softmax in fp32. ``fused``: each chunk's
    math compiled (a compiled step's loss; the loop itself always runs outside compiled graphs)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    x, w, group, start = _local_head(hidden, weight)
    x, t = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    need_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    cdt = compute_dtype or x.dtype
    total = _apply_outside_graphs(x, w, t, int(chunk), cdt, group, start, need_grad, fused)
    if reduction == "sum":
        return total
    return total / (t != IGNORE_INDEX).sum()
