"""torch.compile of the blocks and of the loss (``train.compile``).

Each block is compiled whole with ``fullgraph=True`` where its forward traces as one graph:
then nothing falls back to eager in the middle of a block, and a change that breaks the
graph fails loudly instead of silently slowing the step. ``torch._dynamo.explain`` on CPU
(tests/integration/test_compile_blocks.py) finds one graph and no break for a dense block, with or
without activation checkpointing and under FSDP2. A mixture-of-experts block does not hold:
its routing has data-dependent shapes (``torch.bincount`` of the chosen experts, the token
sort of the capacity drop) and reads autograd's graph task to tell a recomputation
(models/moe.py ``recomputing``), so it is compiled in pieces (``fullgraph=False``), with the
reason in the run's ``compile`` event.

The loss is compiled as one call (``compile_loss``): the step computes it through this one
function, whatever the loss object does inside (models/loss.py), so the fp32 upcast and the
log-softmax fuse; the object's own bookkeeping runs around the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MOE_REASON = (
    "MoE routing has data-dependent shapes (torch.bincount of the chosen experts, the capacity drop's token "
    "sort) and reads autograd's graph task (recomputing()): graph breaks, so it compiles in pieces"
)


def _inner(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)  # (activation checkpointing's wrapper)


def _is_moe(block: nn.Module) -> bool:
    ffn = getattr(_inner(block), "feed_forward", None)
    return ffn is not None and hasattr(ffn, "router")


def fullgraph_reason(block: nn.Module) -> str | None:
    """Why ``block`` cannot compile as one graph (None: it can)."""
    return MOE_REASON if _is_moe(block) else None


def compile_blocks(blocks: list[nn.Module]) -> dict[str, Any]:
    """Compile each block in place, whole where it holds; returns the plan for the run's event."""
    fallback: dict[str, list[int]] = {}
    for i, block in enumerate(blocks):
        reason = fullgraph_reason(block)
        block.compile(fullgraph=reason is None)
        if reason is not None:
            fallback.setdefault(reason, []).append(getattr(_inner(block), "layer_id", i))
    return compile_plan_event(blocks, fallback)


def compile_plan_event(blocks: list[nn.Module], fallback: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """``{"fullgraph_blocks": n, "fallback": [{"blocks": [...], "reason": ...}]}``."""
    if fallback is None:
        fallback = {}
        for i, block in enumerate(blocks):
            reason = fullgraph_reason(block)
            if reason is not None:
                fallback.setdefault(reason, []).append(getattr(_inner(block), "layer_id", i))
    n_fallback = sum(len(v) for v in fallback.values())
    return {
        "fullgraph_blocks": len(blocks) - n_fallback,
        "fallback": [{"blocks": ids, "reason": r} for r, ids in fallback.items()],
    }


def compile_loss(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The loss call, compiled (graph breaks allowed: the loss object keeps Python state). The
    chunked loss's loop stays outside the graph and compiles each chunk's math on its own
    (models/chunked_loss.py: traced whole, the partitioner kept every chunk's logits gradient)."""
    if hasattr(loss, "fused_chunks"):
        loss.fused_chunks = True
    return torch.compile(loss)
