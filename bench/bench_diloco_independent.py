"""DiLoCo against one model on the global batch, in a plain PyTorch loop written apart from
meshforge's trainer (its own AdamW steps, LR schedule, clipping and outer Nesterov update; only
the debug model, the default corpus and the sampler come from meshforge), one process.

It answers questions about docs/diloco.md's validation-loss gap: is it meshforge's, or the
algorithm's at this scale, and where in a round is it lost? The defaults are
bench/bench_diloco.py's settings (debug model, 200 steps x 16 x 128 tokens, 4 islands of batch
4, H = 50, AdamW lr 3e-3 with 20 warm-up steps and cosine to 0.1x, clip 1.0; validation on 128
evenly spread sequences).

    python bench/bench_diloco_independent.py                                   # outer lr 0.7, momentum 0.9
    python bench/bench_diloco_independent.py --outer-lr 1 --outer-momentum 0   # plain averaging
    python bench/bench_diloco_independent.py --inner-steps 1 --outer-lr 1 --outer-momentum 0  # average every step
    python bench/bench_diloco_independent.py --batch 64 --steps 400 --warmup 40 --ddp-steps 100
    python bench/bench_diloco_independent.py --rounds                          # per round: where the gap comes from

``--rounds`` prints, at the end of every round, DDP's validation loss, each island's, that of
the islands' plain average and that after the outer step (the weights every island continues from).
"""

from __future__ import annotations

import argparse
import copy
import math

import numpy as np
import torch
import torch.nn.functional as F

from meshforge.config import load_config
from meshforge.data.corpus import open_data
from meshforge.data.sampler import GlobalBatchSampler
from meshforge.models.llama import build_model
from meshforge.resolve import resolve


def lr_at(a: argparse.Namespace, step: int, peak: float) -> float:
    if step <= a.warmup:
        return peak * step / a.warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - a.warmup) / (a.steps - a.warmup))))


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """meshforge's groups: no weight decay on norms and embeddings."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "emb" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, lr: float) -> None:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()


@torch.no_grad()
def val_loss(model: torch.nn.Module, val, n: int) -> float:
    chosen = np.arange(n, dtype=np.int64) * len(val) // n  # meshforge's evaluator's sequences
    total = count = 0.0
    for i in range(0, n, 16):
        b = val.get(chosen[i : i + 16])
        logits = model(b[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
        count += b[:, 1:].numel()
    return total / count


class Islands:
    """M copies of one model, each with its own AdamW, and the outer weights and momentum (fp64)."""

    def __init__(self, start: torch.nn.Module, opt: torch.optim.Optimizer, a: argparse.Namespace):
        self.a, self.models = a, [copy.deepcopy(start) for _ in range(a.islands)]
        self.opts = [adamw(m, a.lr) for m in self.models]
        for o in self.opts:  # after a DDP warm-up every island starts from its state
            o.load_state_dict(opt.state_dict())
        self.outer = [p.detach().double().clone() for p in start.parameters()]
        self.buf = [torch.zeros_like(p) for p in self.outer]

    def step(self, data, sampler, step: int) -> None:
        a, per = self.a, self.a.batch // self.a.islands
        for i, (m, o) in enumerate(zip(self.models, self.opts, strict=True)):  # island i: slice i of the batch
            batch = data.train.get(sampler.indices((step - 1) * a.batch + i * per, per))
            train_step(m, o, batch, lr_at(a, step, a.inner_lr or a.lr))

    @torch.no_grad()
    def average(self) -> torch.nn.Module:
        avg = copy.deepcopy(self.models[0])
        for p, *ps in zip(avg.parameters(), *(m.parameters() for m in self.models), strict=True):
            p.copy_(sum(q.double() for q in ps) / len(ps))
        return avg

    @torch.no_grad()
    def outer_step(self) -> None:
        """Nesterov SGD on the mean pseudo-gradient (torch.optim.SGD's update), then every island takes it."""
        lr, mu = self.a.outer_lr, self.a.outer_momentum
        for j, ps in enumerate(zip(*(m.parameters() for m in self.models), strict=True)):
            delta = sum(self.outer[j] - p.double() for p in ps) / len(ps)
            self.buf[j].mul_(mu).add_(delta)
            self.outer[j] -= lr * (delta + mu * self.buf[j])
            for p in ps:
                p.copy_(self.outer[j])


def run(a: argparse.Namespace) -> tuple[float, float]:
    over = {"model.preset": "debug", "train.seq_len": a.seq_len, "train.global_batch_size": a.batch}
    cfg = resolve(load_config(None, {**over, "train.device": "cpu"}), 1)
    shape = cfg.shape
    init, data = build_model(shape, seed=cfg.train.seed), open_data(cfg, shape)
    sampler = GlobalBatchSampler(len(data.train), a.batch, cfg.train.seed)
    ddp, islands = copy.deepcopy(init), None
    opt = adamw(ddp, a.lr)
    for step in range(1, a.steps + 1):  # DDP all along; DiLoCo's islands split off it after --ddp-steps
        if step > a.ddp_steps and islands is None:
            islands = Islands(ddp, opt, a)
        train_step(ddp, opt, data.train.get(sampler.indices((step - 1) * a.batch, a.batch)), lr_at(a, step, a.lr))
        if islands is None:
            continue
        islands.step(data, sampler, step)
        if (step - a.ddp_steps) % a.inner_steps == 0:
            report_round(a, islands, ddp, data.val, step)
            islands.outer_step()
    return val_loss(ddp, data.val, a.val_seqs), val_loss(islands.models[0], data.val, a.val_seqs)


def report_round(a: argparse.Namespace, islands: Islands, ddp: torch.nn.Module, val, step: int) -> None:
    if not a.rounds:
        return
    each = " ".join(f"{val_loss(m, val, a.val_seqs):.4f}" for m in islands.models)
    avg = val_loss(islands.average(), val, a.val_seqs)
    after = copy.deepcopy(islands)
    after.outer_step()
    print(
        f"step {step}: DDP {val_loss(ddp, val, a.val_seqs):.4f} | islands {each} | their average {avg:.4f} "
        f"| after the outer step {val_loss(after.models[0], val, a.val_seqs):.4f}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences); each island takes batch / islands")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak LR (DDP's; the islands' unless --inner-lr)")
    p.add_argument("--inner-lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=20, help="LR warm-up steps")
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=50, help="H")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--ddp-steps", type=int, default=0, help="DDP steps before the islands split (diloco.warmup_steps)")
    p.add_argument("--val-seqs", type=int, default=128)
    p.add_argument("--rounds", action="store_true", help="per round: DDP, islands, their average, after the outer step")
    a = p.parse_args()
    if (a.steps - a.ddp_steps) % a.inner_steps or a.batch % a.islands:
        p.error("--steps minus --ddp-steps must be a multiple of --inner-steps, and --batch of --islands")
    torch.set_num_threads(1)
    ddp, dl = run(a)
    print(f"one model on the global batch (= DDP): val loss {ddp:.4f}")
    outer = f"outer {a.outer_lr} / {a.outer_momentum}"
    print(f"DiLoCo, {a.islands} islands, H = {a.inner_steps}, {outer}: val loss {dl:.4f}")
    print(f"gap: {100 * (dl / ddp - 1):+.1f}% (target within 3%)")


if __name__ == "__main__":
    main()
