"""One optimizer parameter group of bf16 ZeRO-1 (zero1.py) as flat buffers cut into buckets.

The group's parameters and gradients are views into one flat working-dtype buffer each,
padded to a multiple of the N ranks and cut into buckets of about ``bucket_elems`` elements
(each a multiple of N, boundaries anywhere, even inside a parameter). Rank r owns the r-th 1/N
of every bucket, so a bucket is one reduce-scatter (its gradients, rank-major, are exactly the
collective's input) and one all-gather; this rank's fp32 master shard is its pieces one after
another: S = padded / N elements whatever the buckets. One bucket is the contiguous slice
[r S, (r+1) S) of the whole buffer.
"""

from __future__ import annotations

import torch
from torch import nn


def bucket_bounds(total: int, n: int, bucket_elems: int) -> list[tuple[int, int]]:
    """(start, size) of each bucket of a buffer of ``total`` elements (a multiple of n), sizes multiples of n."""
    step = max(n, bucket_elems // n * n)
    return [(a, min(step, total - a)) for a in range(0, total, step)]


class FlatGroup:
    """One parameter group's flat buffers, buckets, and this rank's fp32 master shard."""

    def __init__(self, params: list[nn.Parameter], n: int, rank: int, dtype: torch.dtype, bucket_elems: int):
        self.params, self.n, self.rank = params, n, rank
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel, self.shard = numel, -(-numel // n)
        self.buckets = bucket_bounds(self.shard * n, n, bucket_elems)
        self.starts = [0]  # where each bucket's piece starts in a rank's shard
        for _, size in self.buckets[:-1]:
            self.starts.append(self.starts[-1] + size // n)
        device = params[0].device
        full = torch.zeros(self.shard * n, dtype=torch.float32, device=device)
        for p, o in zip(params, self.offsets, strict=True):
            full[o : o + p.numel()].copy_(p.detach().reshape(-1))
        self.master = self.own(full).clone()
        self.param_flat = full.to(dtype)
        del full
        self.grad_flat = torch.zeros_like(self.param_flat)
        for p, o in zip(params, self.offsets, strict=True):
            p.grad = None
            p.data = self.param_flat[o : o + p.numel()].view(p.shape)
        self.attach_grads()
        # per parameter, the buckets its gradient is part of
        self.touches = [
            [k for k, (a, size) in enumerate(self.buckets) if a < o + p.numel() and o < a + size]
            for p, o in zip(params, self.offsets, strict=True)
        ]

    def attach_grads(self) -> None:
        """Point every .grad at its slice of the flat gradient buffer (autograd then accumulates in place)."""
        for p, o in zip(self.params, self.offsets, strict=True):
            p.grad = self.grad_flat[o : o + p.numel()].view(p.shape)

    def bucket(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Bucket ``k`` of a flat buffer of this layout (rank-major pieces)."""
        a, size = self.buckets[k]
        return flat[a : a + size]

    def piece(self, shard: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's piece of bucket ``k`` inside a shard-sized tensor."""
        return shard[self.starts[k] : self.starts[k] + self.buckets[k][1] // self.n]

    def own(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full flat tensor: its piece of every bucket (a view for one bucket)."""
        parts = [self.bucket(full, k).view(self.n, -1)[self.rank] for k in range(len(self.buckets))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full flat tensor from every rank's shard, concatenated rank by rank (an all-gather)."""
        rows = gathered.view(self.n, self.shard)
        if len(self.buckets) == 1:
            return gathered
        sizes = [size // self.n for _, size in self.buckets]
        parts = [rows[:, s : s + size].reshape(-1) for s, size in zip(self.starts, sizes, strict=True)]
        return torch.cat(parts)

    def pieces(self, full: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per parameter (by id), its view in a full flat tensor of this group's layout."""
        return {id(p): full[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets, strict=True)}
