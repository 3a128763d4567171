"""What ring attention (``context_parallel.py``) costs, as formulas: the bytes a cp rank sends
and the activation bytes it keeps. One source for the code's tests, the communication
check and the planner (``planner/estimate.py``), so the estimate is what the code does.
Pure Python: the planner imports it without touching torch.distributed.

Per layer and micro-batch, with T = this rank's tokens (micro_batch × seq_len / cp) and
w = kv_heads × head_dim on this rank (after tp), a K/V block is KV = 2·T·w·e bytes (e the
activation element size) and its gradient G = 2·T·w·max(e, 4) (gradients travel in fp32):

- ``ring``: forward sends its block cp−1 times ((cp−1)/cp of the sequence's K and V);
  backward runs the ring again (cp−1 hops of K/V) and the dK/dV sums travel with their
  block all the way back to the owner (cp hops of G);
- ``allgather``: one all-gather of every block in forward and again in backward (a ring
  all-gather sends (cp−1)·KV per rank) and one all-reduce of every rank's dK/dV (cp blocks
  of G, 2(cp−1)/cp of it on the wire per rank: 2(cp−1)·G).

Recomputing the block in backward (activation checkpointing) runs the forward's traffic once more.
"""

from __future__ import annotations

import math


def local_tokens(seq_len: int, cp: int) -> int:
    """Tokens of each sequence a cp rank holds (both balance modes give every rank the same count)."""
    return seq_len // cp


def ring_bytes(
    tokens: float, kv_width: float, cp: int, rotate: str = "ring", bytes_per: int = 4, recompute: bool = False
) -> dict[str, float]:
    """Bytes one cp rank sends for one layer and micro-batch, by part: ``forward_kv``,
    ``backward_kv`` (K/V again, plus the recomputed forward's), ``backward_grads`` (dK/dV)."""
    if cp <= 1:
        return {"forward_kv": 0.0, "backward_kv": 0.0, "backward_grads": 0.0}
    kv = 2.0 * tokens * kv_width * bytes_per
    grads = 2.0 * tokens * kv_width * max(bytes_per, 4)
    forward = (cp - 1) * kv
    backward_grads = cp * grads if rotate == "ring" else 2 * (cp - 1) * grads
    return {
        "forward_kv": forward,
        "backward_kv": forward * (2 if recompute else 1),
        "backward_grads": backward_grads,
    }


def ring_messages(cp: int, rotate: str = "ring", recompute: bool = False) -> int:
    """Exchanges one layer and micro-batch waits for (each pays a link's latency once)."""
    if cp <= 1:
        return 0
    forward = cp - 1 if rotate == "ring" else 1
    backward = (cp - 1) + cp if rotate == "ring" else 2
    return forward * (2 if recompute else 1) + backward


def ring_saved_bytes_per_token(heads: float, kv_heads: float, head_dim: int, bytes_per: int = 4) -> float:
    """Bytes ring attention keeps for backward per local token: q, k, v (activation dtype),
    the merged output and its log-sum-exp (fp32)."""
    acc = max(bytes_per, 4)
    return (heads + 2 * kv_heads) * head_dim * bytes_per + heads * (head_dim + 1) * acc


def ring_extra_saved_bytes_per_token(heads: float, head_dim: int, bytes_per: int = 4) -> float:
    """What ring attention keeps beyond a fused single-device kernel's q, k, v and output: the
    log-sum-exp, and the fp32 merged output when activations are narrower (in fp32 the output
    projection's saved input is that same tensor)."""
    acc = max(bytes_per, 4)
    return heads * acc + (heads * head_dim * acc if bytes_per < acc else 0.0)


def ring_block_work(seq_len: int, cp: int, balance: str, mean_doc_len: float = 0.0) -> list[float]:
    """Each cp rank's expected attention work in blocks (a chunk-by-chunk product of scores; the
    causal triangle of a diagonal block counts 1/2), for documents of exponentially distributed
    length with mean ``mean_doc_len`` (0: none, plain causal). Under document masks
    (``parallel/context/document_ring.py``) a block ``d`` chunks before the query chunk is skipped when a
    document starts among the (d - 1)·chunk + 1 tokens between them (probability
    1 - exp(-that / mean)); every other block runs whole, a diagonal one its causal triangle."""
    n = 2 * cp if balance == "zigzag" else cp
    c = seq_len / n
    out = []
    for rank in range(cp):
        mine = (rank, 2 * cp - 1 - rank) if balance == "zigzag" else (rank,)
        work = 0.0
        for a in mine:
            work += 0.5
            for b in range(a):
                work += math.exp(-((a - b - 1) * c + 1) / mean_doc_len) if mean_doc_len > 0 else 1.0
        out.append(work)
    return out


def ring_skipped_fraction(seq_len: int, cp: int, balance: str, mean_doc_len: float) -> float:
    """The expected share of the causal ring's blocks that document masks skip (counted as blocks)."""
    n = 2 * cp if balance == "zigzag" else cp
    c = seq_len / n
    pairs = n * (n + 1) / 2
    skipped = sum(-math.expm1(-((a - b - 1) * c + 1) / mean_doc_len) for a in range(n) for b in range(a))
    return skipped / pairs if mean_doc_len > 0 else 0.0
