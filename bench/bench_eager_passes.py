"""RoPE and RMSNorm before and after issue 37, side by side in one run on the CPU: the debug
preset's training step (forward, fp32 cross-entropy, backward, AdamW) with the current
formulas against the previous ones (patched in), blocks of steps alternating, median block
time; plus each side's aten ops per step (a dispatch mode: views left out, each op left is a
kernel on a GPU) and a bit-for-bit comparison of the two sides' losses.

    python bench/bench_eager_passes.py                     # debug preset, fp32 and bf16 autocast
    python bench/bench_eager_passes.py --precision fp32 --batch 4 --blocks 9 --threads 1   # a busy machine

Ratio = previous / current step time (above 1: the current formulas are faster).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.models import llama
from meshforge.models.llama import build_model
from meshforge.models.presets import get_preset

VIEWS = {"view", "_unsafe_view", "t", "transpose", "detach", "expand", "slice", "unsqueeze", "alias", "as_strided"}


def previous_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables before issue 37: cos and plain sin of (seq, head_dim), in fp32."""
    with torch.autocast(device_type=positions.device.type, enabled=False):
        freqs = torch.outer(positions.float(), inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def previous_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE before issue 37: rotate-half with neg and cat, both operands cast to fp32."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def previous_rms_norm(self: llama.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm before issue 37: x.float(), rms_norm, times weight.float(), cast back."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()).to(x.dtype)


@contextlib.contextmanager
def previous_formulas() -> Iterator[None]:
    """The model's RoPE and RMSNorm as they were before issue 37, for the length of the block."""
    saved = llama.rope_cos_sin, llama.apply_rope, llama.RMSNorm.forward
    llama.rope_cos_sin, llama.apply_rope, llama.RMSNorm.forward = previous_cos_sin, previous_rope, previous_rms_norm
    try:
        yield
    finally:
        llama.rope_cos_sin, llama.apply_rope, llama.RMSNorm.forward = saved


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def make_step(precision: str, batch: int, seq: int) -> tuple[Callable[[], float], torch.nn.Module]:
    """One training step of a fresh debug-preset model (seed 0), returning the loss."""
    model = build_model(get_preset("debug"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, model.shape.vocab_size, (batch, seq + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, model


def bench(precision: str, args: argparse.Namespace) -> dict:
    """Both sides' median block time, ops per step and whether their losses stayed identical."""
    cur, _ = make_step(precision, args.batch, args.seq_len)
    prev, _ = make_step(precision, args.batch, args.seq_len)
    losses: dict[str, list[float]] = {"current": [], "previous": []}
    ops = {}
    for name, step in (("current", cur), ("previous", prev)):
        with previous_formulas() if name == "previous" else contextlib.nullcontext(), OpCount() as mode:
            losses[name].append(step())
        ops[name] = sum(mode.count.values())
    times: dict[str, list[float]] = {"current": [], "previous": []}
    for _ in range(args.blocks):
        for name, step in (("current", cur), ("previous", prev)):
            with previous_formulas() if name == "previous" else contextlib.nullcontext():
                t0 = time.perf_counter()
                losses[name] += [step() for _ in range(args.steps)]
                times[name].append((time.perf_counter() - t0) / args.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    same = losses["current"] == losses["previous"]
    return {"precision": precision, **med, "ratio": med["previous"] / med["current"], "ops": ops, "same": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (configs/debug.toml: 16)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"debug preset, batch {a.batch} x {a.seq_len}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "precision | current step | previous step | previous / current | aten ops per step (cur / prev) | same losses"
    )
    for prec in ["fp32", "bf16"] if a.precision == "both" else [a.precision]:
        r = bench(prec, a)
        print(
            f"{prec:>9} | {r['current'] * 1e3:10.1f}ms | {r['previous'] * 1e3:11.1f}ms | {r['ratio']:17.3f}x | "
            f"{r['ops']['current']:,} / {r['ops']['previous']:,} | {r['same']}"
        )


if __name__ == "__main__":
    main()
