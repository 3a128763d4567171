"""Output head + cross-entropy over token chunks, without the full logits.

The plain path materialises ``tokens x vocab`` logits, an fp32 copy and its gradient: at
seq 32768 and a 128K vocabulary that is 15.7 GiB per copy. Here the head's matmul, the fp32
log-softmax and both gradients are computed one chunk of tokens at a time, so at most one
chunk's logits are alive. Like Liger-Kernel's fused linear cross-entropy the gradients are
computed in the forward (the backward only scales them by the incoming gradient), which
costs no extra matmul: three per chunk, the same as the plain forward + backward.

Written for one device. Its seam is ``VocabSlice``: the head rows this device holds and how a
per-token statistic over them (the max, the sum of exponentials, the target's logit) is
completed over every slice. On one device that is the whole vocabulary and nothing to
complete; under tensor parallelism parallel/tensor/vocab_loss.py gives the vocab-sharded
head's slice, which all-reduces over the tp group. The loop has no data-dependent control flow.
"""

from __future__ import annotations

import functools

import torch

from meshforge.models.eager import eager_only

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it count for nothing


class VocabSlice:
    """The head rows a device holds, from vocabulary id ``start`` on, and ``complete``: a per-token
    statistic over them (``op`` "sum" or "max", in place) made the one over the whole vocabulary.
    This base is a device holding it all: nothing to complete."""

    start = 0

    def complete(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t


def _complete(t: torch.Tensor, op: str, vocab: VocabSlice | None) -> torch.Tensor:
    return t if vocab is None else vocab.complete(t, op)


def _chunk_loss(x, wc, t, cdt, vocab: VocabSlice | None, need_grad: bool):
    """Summed loss of one chunk, and (need_grad) d loss / d logits in ``cdt`` (None otherwise)."""
    logits = (x.to(cdt) @ wc.T).float()  # (c, local vocab): the only logits alive
    n_local = logits.shape[1]
    local_t = t - (vocab.start if vocab is not None else 0)
    valid = t != IGNORE_INDEX
    mine = (local_t >= 0) & (local_t < n_local) & valid  # the target's logit lives on this slice
    safe = local_t.clamp(0, n_local - 1).unsqueeze(1)
    target_logit = _complete(logits.gather(1, safe).squeeze(1) * mine, "sum", vocab)
    m = _complete(logits.amax(1), "max", vocab)
    e = logits.sub_(m.unsqueeze(1)).exp_()  # in place: still one chunk
    s = _complete(e.sum(1), "sum", vocab)
    loss = ((m + s.log() - target_logit) * valid).sum()
    if not need_grad:
        return loss, None
    p = e.div_(s.unsqueeze(1))  # softmax
    p.scatter_add_(1, safe, -mine.unsqueeze(1).to(p.dtype))  # minus the one-hot target
    return loss, p.mul_(valid.unsqueeze(1)).to(cdt)


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``x @ w.T`` against ``targets``; gradients computed in forward."""

    @staticmethod
    def forward(ctx, x, w, targets, chunk, cdt, vocab, need_grad, fused):  # noqa: ANN001, ANN205
        chunk_loss = _fused_chunk_loss() if fused and vocab is None else _chunk_loss
        wc = w.to(cdt)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        for start in range(0, x.shape[0], chunk):
            xs, ts = x[start : start + chunk], targets[start : start + chunk]
            part, g = chunk_loss(xs, wc, ts, cdt, vocab, need_grad)
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


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    reduction: str = "mean",
    compute_dtype: torch.dtype | None = None,
    fused: bool = False,
    vocab: VocabSlice | None = None,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets, reduction=reduction)`` (mean over
    the targets that are not IGNORE_INDEX, or their sum), ``chunk`` tokens at a time.

    ``hidden`` (..., H) and ``targets`` (...) are flattened; the logits' matmul runs in
    ``compute_dtype`` (default: ``hidden``'s dtype), the softmax in fp32. ``fused``: each chunk's
    math compiled (a compiled step's loss; the loop itself always runs outside compiled graphs).
    ``vocab``: ``weight`` holds that slice of the vocabulary's rows (None: all of them)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    x, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    cdt = compute_dtype or x.dtype
    total = _apply_outside_graphs(x, weight, t, int(chunk), cdt, vocab, need_grad, fused)
    if reduction == "sum":
        return total
    return total / (t != IGNORE_INDEX).sum()
