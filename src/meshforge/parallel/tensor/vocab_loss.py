"""The chunked loss over a vocab-parallel head (tp > 1): models/chunked_loss.py's one-device
cross-entropy, given this rank's slice of the vocabulary.

Under tensor parallelism the head weight is a vocab-sharded DTensor (``Shard(0)`` on the tp
mesh). Each rank computes its vocabulary's logits of a chunk; the log-sum-exp and the target's
logit are completed with three small all-reduces over the weight's group per chunk (max, sum of
exponentials, target logit). The hidden states' gradient is a partial sum over the vocabulary
shards that the head's input plan reduces (a reduce-scatter under sequence parallelism).
``parallelize.build_loss`` installs this as the run's head loss under tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private: here and data/apply.py

from meshforge.models.chunked_loss import VocabSlice, chunked_cross_entropy

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class ShardedVocab(VocabSlice):
    """A tp rank's rows of the head, from ``start``; a statistic is completed by an all-reduce over ``group``."""

    def __init__(self, group: dist.ProcessGroup, start: int) -> None:
        self.group, self.start = group, start

    def complete(self, t: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(t, op=_OPS[op], group=self.group)
        return t


def _local_head(x: torch.Tensor, w: DTensor) -> tuple[torch.Tensor, torch.Tensor, ShardedVocab]:
    """A vocab-sharded DTensor head's local rows and slice, and the hidden states as this rank's
    plain tensor (whose gradient is a partial sum)."""
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
    return x, w.to_local(), ShardedVocab(w.device_mesh.get_group(), int(start))


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    reduction: str = "mean",
    compute_dtype: torch.dtype | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """``chunked_cross_entropy`` where ``weight`` may be a vocab-sharded DTensor head (a plain
    weight, e.g. a pipeline stage's head that is not sharded, takes the one-device path)."""
    if not isinstance(weight, DTensor):
        return chunked_cross_entropy(hidden, weight, targets, chunk, reduction, compute_dtype, fused)
    x, w, vocab = _local_head(hidden, weight)
    return chunked_cross_entropy(x, w, targets, chunk, reduction, compute_dtype, fused, vocab)
