"""The one place that composes parallelism, in a fixed order:

PP split -> TP/SP -> EP -> CP -> activation checkpointing -> compile -> FSDP/DDP.

The order matters: checkpointing must wrap the (possibly sharded) block, compile must
see the checkpointed block, and data parallelism goes last so its hooks see the final
parameters. This version applies AC, compile and DDP; the other axes are refused by
config validation until they land.
"""

from __future__ import annotations

from torch import nn

from meshforge.config import Config
from meshforge.models.llama import Transformer
from meshforge.parallel.activation_checkpoint import apply_activation_checkpoint
from meshforge.parallel.data_parallel import apply_ddp
from meshforge.parallel.mesh import Mesh


def parallelize(model: Transformer, cfg: Config, mesh: Mesh) -> nn.Module:
    """Apply the configured layout to a materialised single-device model; returns the module to train."""
    blocks = list(model.layers.values())
    apply_activation_checkpoint(blocks, cfg.train.activation_checkpoint)
    if cfg.train.compile:
        for block in blocks:
            block.compile()
    if mesh.dp_size > 1:
        return apply_ddp(model, mesh)
    return model
