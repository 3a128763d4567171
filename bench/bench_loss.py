"""Chunked head + cross-entropy against the plain full-logits loss, side by side in one run
(CPU, fp32): forward + backward time and peak memory of each, and their ratios.

Peak memory is every tensor the loss's forward and backward allocate, alive at once, as
torch's MemTracker counts them (real tensors; the inputs excluded). Times are medians of
interleaved repeats, so machine load hits both alike. Issue 27's CPU target: the chunked
peak <= 1/4 of the plain one at vocab 128256 x seq 4096. The plain path needs ~6 GB here.

    python bench/bench_loss.py                      # vocab 128256, seq 4096, hidden 64, chunk 1024
    python bench/bench_loss.py --seq 1024 --chunk 256 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from meshforge.models.chunked_loss import chunked_cross_entropy


def make_inputs(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, a.seq, a.hidden, generator=g).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).requires_grad_()
    return x, w, torch.randint(0, a.vocab, (1, a.seq), generator=g)


def plain(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int) -> torch.Tensor:
    return F.cross_entropy((x @ w.T).float().flatten(0, 1), t.flatten())


def chunked(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int) -> torch.Tensor:
    return chunked_cross_entropy(x, w, t, chunk)


def run_once(fn, x, w, t, chunk: int) -> tuple[float, float]:  # noqa: ANN001
    """(seconds, loss) of one forward + backward."""
    x.grad = w.grad = None
    start = time.perf_counter()
    loss = fn(x, w, t, chunk)
    loss.backward()
    return time.perf_counter() - start, float(loss.detach())


def peak(fn, x, w, t, chunk: int) -> int:  # noqa: ANN001
    x.grad = w.grad = None
    tracker = MemTracker()
    with tracker:
        fn(x, w, t, chunk).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    x, w, t = make_inputs(a)
    fns = {"plain": plain, "chunked": chunked}
    times: dict[str, list[float]] = {k: [] for k in fns}
    losses = {}
    for _ in range(a.repeats):  # interleaved
        for name, fn in fns.items():
            dt, losses[name] = run_once(fn, x, w, t, a.chunk)
            times[name].append(dt)
    peaks = {name: peak(fn, x, w, t, a.chunk) for name, fn in fns.items()}
    print(f"vocab {a.vocab} x seq {a.seq}, hidden {a.hidden}, chunk {a.chunk}, fp32, {torch.get_num_threads()} threads")
    for name in fns:
        med = statistics.median(times[name])
        print(
            f"  {name:8s} fwd+bwd {med * 1e3:9.1f} ms   peak {peaks[name] / 2**30:7.3f} GiB   loss {losses[name]:.6f}"
        )
    speed = statistics.median(times["plain"]) / statistics.median(times["chunked"])
    print(f"chunked / plain: speed {speed:.2f}x, peak memory {peaks['chunked'] / peaks['plain']:.3f}x")


if __name__ == "__main__":
    main()
