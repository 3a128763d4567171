"""Per-op fixed costs of each parallel layout kind, for ``meshforge calibrate`` on a CPU.

On a CPU a small model's step is dominated by what every op costs whatever its size:
Python, autograd and the dispatcher, and on top of them, under tensor parallelism,
DTensor's sharding propagation and redistributes (vocab-parallel embedding, loss-parallel
cross-entropy, partial norm gradients made whole, clipping over DTensors), and under FSDP2
each unit's hooks, copies into and out of its flat buffers and its collectives' latency.
None of that is visible in a collective's or a matmul's micro-benchmark, and its size per
block differs between the model's blocks and its ends (embedding, head, loss, optimizer).

So a tiny model (a few tokens, tiny hidden size: the work is nothing, the fixed costs are
everything) is trained here the way ``meshforge train`` trains it - the same
``parallelize``, loss, clipping and AdamW - on the calibrating ranks, with 1 and 3 blocks.
The difference per block is the block's share; what 1 block leaves is the ends'. Measured
separately: a micro-batch's forward + backward without gradient reduction, and a whole
step's last micro-batch with the reduction, clipping and the optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

KINDS = {  # layout kind -> config overrides over the calibrating ranks
    "tp": {"parallel.tp": -1, "parallel.dp_shard": 1},
    "fsdp": {"parallel.zero_stage": 3},
}
LAYERS = (1, 3)
TOKENS = 8  # per sequence; one sequence per micro-batch


def _tiny_step(kind: str, layers: int, world: int, timed: Callable[..., float]) -> tuple[float, float]:
    """(seconds of a micro-batch's forward + backward without gradient reduction, seconds of a
    last micro-batch with it plus clipping and the optimizer step) of a tiny ``layers``-block
    model under ``kind``; every rank calls this."""
    from meshforge.config import load_config
    from meshforge.models.llama import build_model
    from meshforge.models.loss import LanguageModelLoss
    from meshforge.models.presets import model_args_from_config
    from meshforge.parallel.data_parallel import gradient_sync
    from meshforge.parallel.grad_clip import clip_grad_norm
    from meshforge.parallel.mesh import build_mesh
    from meshforge.parallel.parallelize import parallelize
    from meshforge.parallel.tensor_parallel import loss_context, match_grad_layouts
    from meshforge.resolve import layout, resolve
    from meshforge.train.optimizer import build_optimizer

    over = {
        **{f"model.{k}": v for k, v in dict(hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256).items()},
        "model.layers": layers,
        "train.seq_len": TOKENS,
        "train.global_batch_size": world,
        "train.micro_batch_size": 1,
        "train.precision": "fp32",
        "train.device": "cpu",
        **KINDS[kind],
    }
    cfg = resolve(load_config(overrides=over), world)
    mesh = build_mesh(layout(cfg, world), "cpu")
    model = build_model(model_args_from_config(cfg.model), device="meta")
    train_model = parallelize(model, cfg, mesh, seed=0)
    opt = build_optimizer(model, cfg, mesh)
    tp = mesh.degrees["tp"] > 1
    loss = LanguageModelLoss(lambda: loss_context(tp), chunk_size=cfg.train.loss_chunk_size)
    x = torch.randint(0, 256, (1, TOKENS + 1))
    pos = torch.arange(TOKENS)

    def fwd_bwd(sync: bool) -> None:
        with gradient_sync(train_model, sync), loss.context():
            loss(train_model(x[:, :-1], pos), x[:, 1:], model).backward()

    def step() -> None:
        fwd_bwd(True)
        if tp:
            match_grad_layouts(model)
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.end_step()

    micro = timed(lambda: fwd_bwd(False))
    opt.zero_grad(set_to_none=True)
    return micro, timed(step)


def layout_fixed_costs(world: int, timed: Callable[..., float]) -> dict[str, dict[str, float]]:
    """Per kind: seconds per block and for the ends (embedding, head, loss), per micro-batch
    (``block``, ``ends``) and per step on top of the last micro-batch's (``block_step``,
    ``ends_step``: gradient reduction, clipping, optimizer). ``timed(fn)``: seconds per call,
    ranks lined up. Every rank calls this; the slowest rank's figures count (the caller's)."""
    os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    out = {}
    for kind in KINDS:
        (m1, s1), (m3, s3) = (_tiny_step(kind, n, world, timed) for n in LAYERS)
        block, block_last = (m3 - m1) / (LAYERS[1] - LAYERS[0]), (s3 - s1) / (LAYERS[1] - LAYERS[0])
        out[kind] = {
            "block": max(block, 0.0),
            "ends": max(m1 - block, 0.0),
            "block_step": max(block_last - block, 0.0),
            "ends_step": max(s1 - block_last - (m1 - block), 0.0),
        }
    return out
