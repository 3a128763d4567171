"""Per-op fixed costs of each parallel layout kind, for ``meshforge calibrate`` on a CPU.

On a CPU a small model's step is dominated by what every op costs whatever its size:
Python, autograd and the dispatcher, and on top of them, under tensor parallelism,
DTensor's sharding propagation and redistributes (vocab-parallel embedding, loss-parallel
cross-entropy, partial norm gradients made whole, clipping over DTensors), and under FSDP2
each unit's hooks, copies into and out of its flat buffers and its collectives' latency.
None of that is visible in a collective's or a matmul's micro-benchmark, and its size per
block differs between the model's blocks and its ends (embedding, head, loss, optimizer).

So a tiny model (a few tokens, tiny hidden size: the work is nothing, the fixed costs are
everything) is trained here by ``meshforge train``'s own step runner (train/step.py, built
from the same parts: ``parallelize``, loss, clipping, AdamW, LR schedule) on the calibrating
ranks, with 1 and 3 blocks. The difference per block is the block's share; what 1 block
leaves is the ends'. Measured separately: a micro-batch's forward + backward without
gradient reduction, and a whole step's last micro-batch with the reduction, clipping and
the optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from meshforge.config import load_config
from meshforge.parallel.mesh import build_mesh
from meshforge.resolve import resolve
from meshforge.train.standalone_step import standalone_step
from meshforge.train.step import PlainStep

KINDS = {  # layout kind -> config overrides over the calibrating ranks
    "tp": {"parallel.tp": -1, "parallel.dp_shard": 1},
    "fsdp": {"parallel.zero_stage": 3},
}
LAYERS = (1, 3)
TOKENS = 8  # per sequence; one sequence per micro-batch


def _tiny_runner(kind: str, layers: int, world: int) -> PlainStep:
    """train/step.py's plain step runner over a tiny ``layers``-block model under ``kind``,
    built from the parts ``meshforge train`` builds it from (model setup, loss, optimizer,
    LR schedule, the step's hooks); one micro-batch of one sequence per step."""
    over = {
        **{f"model.{k}": v for k, v in dict(hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256).items()},
        "model.layers": layers,
        "train.seq_len": TOKENS,
        "train.global_batch_size": world,
        "train.micro_batch_size": 1,
        "train.precision": "fp32",
        "train.device": "cpu",
        "train.seed": 0,
        **KINDS[kind],
    }
    plan = resolve(load_config(overrides=over), world)
    return standalone_step(plan, build_mesh(plan.layout, "cpu"), step_hook=True).runner


def _tiny_step(kind: str, layers: int, world: int, timed: Callable[..., float]) -> tuple[float, float]:
    """(seconds of a micro-batch's forward + backward without gradient reduction, seconds of a
    last micro-batch with it plus clipping and the optimizer step) of a tiny ``layers``-block
    model under ``kind``: a step of one micro-batch is the second; a step of two (the first
    without gradient reduction) less a step of one is the first. Every rank calls this."""
    runner = _tiny_runner(kind, layers, world)
    # one sequence per micro-batch, one micro-batch per step: the runner takes its split from the plan
    # (under tp every rank holds the whole batch of `world` sequences: two micro-batches of one)
    runner.micro, runner.accum = 1, 1
    batch = torch.randint(0, 256, (2, TOKENS + 1))
    step = timed(lambda: runner.run(batch[:1], measure=False))
    runner.accum = 2
    return timed(lambda: runner.run(batch, measure=False)) - step, step


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
