"""DiLoCo against one model on the global batch, in a plain PyTorch loop written apart from
meshforge's trainer (its own AdamW steps, LR schedule, clipping and outer Nesterov update; only
the debug model, the default corpus and the sampler come from meshforge), one process.

It answers one question about docs/diloco.md's validation-loss gap: is it meshforge's, or
the algorithm's at this scale? The same settings as bench/bench_diloco.py (debug model, 200
steps x 16 x 128 tokens, 4 islands of batch 4, H = 50, AdamW lr 3e-3 with 20 warm-up steps
and cosine to 0.1x, clip 1.0; validation on the same 128 evenly spread sequences).

    python bench/bench_diloco_independent.py                       # outer lr 0.7, momentum 0.9
    python bench/bench_diloco_independent.py --outer-lr 1 --outer-momentum 0   # plain averaging
"""

from __future__ import annotations

import argparse
import copy
import math

import numpy as np
import torch
import torch.nn.functional as F

from meshforge.config import load_config
from meshforge.data.sampler import GlobalBatchSampler
from meshforge.models.llama import build_model
from meshforge.models.presets import model_shape
from meshforge.train.run_dir import open_data

STEPS, BATCH, SEQ, ISLANDS, H, LR, WARMUP = 200, 16, 128, 4, 50, 3e-3, 20


def lr_at(step: int) -> float:
    if step <= WARMUP:
        return LR * step / WARMUP
    return LR * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP))))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """meshforge's groups: no weight decay on norms and embeddings."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "emb" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, step: int) -> None:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for g in opt.param_groups:
        g["lr"] = lr_at(step)
    opt.step()


@torch.no_grad()
def val_loss(model: torch.nn.Module, val) -> float:
    n = 8 * BATCH
    chosen = np.arange(n, dtype=np.int64) * len(val) // n  # meshforge's evaluator's sequences
    total = count = 0.0
    for i in range(0, n, BATCH):
        b = val.get(chosen[i : i + BATCH])
        logits = model(b[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
        count += b[:, 1:].numel()
    return total / count


def diloco(init, data, sampler, outer_lr: float, momentum: float) -> float:
    islands = [copy.deepcopy(init) for _ in range(ISLANDS)]
    opts = [adamw(m) for m in islands]
    outer = [p.detach().clone() for p in init.parameters()]
    buf = [torch.zeros_like(p) for p in outer]
    per = BATCH // ISLANDS
    for step in range(1, STEPS + 1):
        for i, (m, o) in enumerate(zip(islands, opts, strict=True)):  # island i: slice i of the global batch
            train_step(m, o, data.train.get(sampler.indices((step - 1) * BATCH + i * per, per)), step)
        if step % H:
            continue
        with torch.no_grad():  # outer Nesterov SGD on the mean pseudo-gradient (torch.optim.SGD's update)
            for j, ps in enumerate(zip(*(m.parameters() for m in islands), strict=True)):
                delta = sum(outer[j] - p for p in ps) / ISLANDS
                buf[j].mul_(momentum).add_(delta)
                outer[j] -= outer_lr * (delta + momentum * buf[j])
                for p in ps:
                    p.copy_(outer[j])
    return val_loss(islands[0], data.val)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    a = p.parse_args()
    torch.set_num_threads(1)
    over = {"model.preset": "debug", "train.seq_len": SEQ, "train.global_batch_size": BATCH, "train.device": "cpu"}
    cfg = load_config(None, over)
    shape = model_shape(cfg.model)
    init, data = build_model(shape, seed=cfg.train.seed), open_data(cfg, shape)
    sampler = GlobalBatchSampler(len(data.train), BATCH, cfg.train.seed)
    one = copy.deepcopy(init)
    opt = adamw(one)
    for step in range(1, STEPS + 1):
        train_step(one, opt, data.train.get(sampler.indices((step - 1) * BATCH, BATCH)), step)
    ddp = val_loss(one, data.val)
    dl = diloco(init, data, sampler, a.outer_lr, a.outer_momentum)
    print(f"one model on the global batch (= DDP): val loss {ddp:.4f}")
    print(f"DiLoCo, {ISLANDS} islands, H = {H}, outer {a.outer_lr} / {a.outer_momentum}: val loss {dl:.4f}")
    print(f"gap: {100 * (dl / ddp - 1):+.1f}% (target within 3%)")


if __name__ == "__main__":
    main()
