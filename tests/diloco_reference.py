"""The single-process DiLoCo reference for tests/integration/test_diloco.py: M islands stepped one after
another in one process (each a world-of-one Trainer with its own AdamW), their
pseudo-gradients averaged and the outer Nesterov update applied by hand -- written from
the papers, not from parallel/diloco/outer.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from meshforge.config import Config
from meshforge.config.layout import Layout
from meshforge.parallel.mesh import Mesh
from meshforge.resolve import resolve
from meshforge.train.loop import Trainer


def island_trainers(cfg: Config, root: Path, islands: int) -> list[Trainer]:
    """One world-of-one Trainer per island (same seed: the same initial weights)."""
    base = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, islands=1))
    base = resolve(base, 1)
    out = []
    for i in range(islands):
        c = base.with_run_dir(str(root / f"island{i}"))
        Path(c.run.dir).mkdir(parents=True, exist_ok=True)
        out.append(Trainer(c, Mesh(0, 1, 0, torch.device("cpu"), Layout())))
    return out


def block_fragment(name: str, layers: int, fragments: int) -> int:
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) * fragments // layers
    return 0 if name.startswith("tok_embeddings") else fragments - 1


def simulate(cfg: Config, root: Path, identical: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Island 0's loss per step and the final weights of island 0 (the outer weights when
    train.steps is a multiple of diloco.inner_steps). One thread, as each rank of a
    ``--nproc`` run on this machine: the same matmul kernels, so the same rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg, root, identical)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg: Config, root: Path, identical: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    d, t = cfg.diloco, cfg.train
    m, h, f, tau = cfg.layout.islands, d.inner_steps, d.fragments, d.delay
    trainers = island_trainers(cfg, root, m)
    params = [dict(tr.model.named_parameters()) for tr in trainers]
    outer = {n: p.detach().double() for n, p in params[0].items()}  # the outer state in fp64
    buf = {n: torch.zeros_like(p) for n, p in outer.items()}
    frag = {n: block_fragment(n, cfg.shape.layers, f) for n in outer}
    sampler = trainers[0].state.sampler
    per = t.global_batch_size // m
    sent: dict[int, dict[str, torch.Tensor]] = {}
    losses = []
    for step in range(1, t.steps + 1):
        for i, tr in enumerate(trainers):
            idx = sampler.indices(sampler.consumed + (0 if identical else i) * per, per)
            batch = tr.data.train.get(idx)
            res = tr.runner.run(batch, True, tr.runner.packing.documents(batch))  # as Trainer.step_once
            if i == 0:
                losses.append(res.global_loss)
        sampler.consumed += t.global_batch_size
        pos = (step - 1) % h + 1
        for k in range(f):
            due = (k + 1) * h // f
            if pos == due - tau:
                wire = {n: [(outer[n] - p[n].double()).float() for p in params] for n in outer}  # exact, then fp32
                sent[k] = {n: average(pgs, d.sync_dtype) for n, pgs in wire.items()}
            if pos == due:
                with torch.no_grad():
                    for n in (n for n in outer if frag[n] == k):  # Nesterov SGD, op for op as torch's
                        g = sent[k][n]
                        buf[n].mul_(d.outer_momentum).add_(g)
                        step_dir = g.add(buf[n], alpha=d.outer_momentum) if d.nesterov else buf[n]
                        outer[n].add_(step_dir, alpha=-d.outer_lr)
                        for p in params:
                            p[n].copy_(outer[n])
    return losses, {n: p.detach().clone() for n, p in params[0].items()}


def average(pgs: list[torch.Tensor], dtype: str) -> torch.Tensor:
    """The islands' mean pseudo-gradient as the wire carries it (bf16: summed in bf16)."""
    if dtype == "bf16":
        total = pgs[0].bfloat16()
        for g in pgs[1:]:
            total = total + g.bfloat16()
        return total.double() / len(pgs)
    assert dtype == "fp32", "the reference models fp32 and bf16 sync"
    total = pgs[0].clone()
    for g in pgs[1:]:
        total = total + g
    return total.double() / len(pgs)
