"""Mixture of experts: the grouped GEMM against the loop over experts, the three balance
modes over a 300-step run, and expert parallelism's speed and all-to-all bytes.

(a) ``grouped``: one MoE expert stack (SwiGLU, E experts, tokens sorted by expert with a
    skewed load) forward + backward, ``torch._grouped_mm`` vs the exact loop over experts,
    alternating rounds, same shapes; on CUDA in bf16 too when a GPU is present.
(b) ``balance``: debug-moe trained N steps with load_balance = aux_loss, bias and none:
    max/mean tokens per expert (the worst MoE layer) over time, and the final loss.
(c) ``ep``: debug-moe on 2 ranks, ep = 1 (DDP) vs ep = 2: tokens/s, and the measured
    token all-to-all bytes of rank 0 against 2 x 2 x tokens x k x hidden x bytes x (ep-1)/ep
    per MoE layer (the mean over the ranks equals it exactly; one rank's share follows its
    routing).

    python bench/bench_moe.py                 # all three
    python bench/bench_moe.py --part grouped --tokens 8192
    python bench/bench_moe.py --part balance --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshforge.models.moe import grouped_matmul, grouped_mm_supported


def _expert_step(x: torch.Tensor, ws: list[torch.Tensor], counts: torch.Tensor, grouped: bool) -> None:
    w1, w2, w3 = ws
    h = torch.nn.functional.silu(grouped_matmul(x, w1, counts, grouped)) * grouped_matmul(x, w3, counts, grouped)
    grouped_matmul(h, w2, counts, grouped).square().mean().backward()


def bench_grouped(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """Median seconds of forward + backward, grouped vs loop, alternating rounds."""
    e, h, f, t = args.experts, args.hidden, args.ffn, args.tokens
    gen = torch.Generator().manual_seed(0)
    share = torch.softmax(torch.randn(e, generator=gen) * 1.5, 0)  # a skewed load, like a real router's
    counts = (share * t).long()
    counts[0] += t - counts.sum()
    x = torch.randn(t, h, generator=gen).to(device, dtype).requires_grad_()
    ws = [
        (torch.randn(e, *s, generator=gen) * 0.05).to(device, dtype).requires_grad_() for s in ((f, h), (h, f), (f, h))
    ]
    counts = counts.to(device)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds + 1):
        for grouped in (True, False):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            _expert_step(x, ws, counts, grouped)
            if device == "cuda":
                torch.cuda.synchronize()
            if r:  # round 0 warms up
                times[grouped].append(time.perf_counter() - t0)
            x.grad = None
            for w in ws:
                w.grad = None
    g, loop = statistics.median(times[True]), statistics.median(times[False])
    return {"device": device, "dtype": str(dtype).split(".")[-1], "grouped_ms": g * 1e3, "loop_ms": loop * 1e3}


def part_grouped(args: argparse.Namespace) -> None:
    print(
        f"\n(a) expert stack fwd+bwd: {args.tokens} tokens x k sorted over {args.experts} experts, "
        f"hidden {args.hidden}, expert ffn {args.ffn}, median of {args.rounds} alternating rounds"
    )
    print("| device | dtype | grouped GEMM (ms) | loop over experts (ms) | loop / grouped |")
    print("|---|---|---|---|---|")
    cases = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
    if torch.cuda.is_available():
        cases += [("cuda", torch.bfloat16), ("cuda", torch.float32)]
    for device, dtype in cases:
        if not grouped_mm_supported(torch.device(device), dtype):
            print(f"| {device} | {dtype} | not supported here | | |")
            continue
        r = bench_grouped(args, device, dtype)
        print(
            f"| {device} | {r['dtype']} | {r['grouped_ms']:.2f} | {r['loop_ms']:.2f} | "
            f"{r['loop_ms'] / r['grouped_ms']:.2f} |"
        )


def _train(overrides: dict, nproc: int = 1) -> Path:
    d = Path(tempfile.mkdtemp()) / "run"
    cmd = [sys.executable, "-m", "meshforge", "train", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    over = {**overrides, "run.dir": str(d), "metrics.console": False}
    cmd += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return d


def _records(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def part_balance(args: argparse.Namespace) -> None:
    """debug-moe's routing (8 experts, top-2) on a narrower body (--balance-hidden, 2 blocks,
    one of them MoE) so that 3 x 300 steps fit a shared 2-core machine."""
    log = max(1, args.steps // 6)
    base = {
        "model.preset": "debug-moe",
        "model.hidden": args.balance_hidden,
        "model.moe_ffn_hidden": args.balance_hidden,
        "model.layers": 2,
        "train.steps": args.steps,
        "train.seq_len": 64,
        "train.global_batch_size": 8,
        "train.eval_batches": 0,
        "metrics.log_interval": log,
        "metrics.report": False,
        "metrics.tensorboard": False,
    }
    steps = list(range(log, args.steps + 1, log))
    print(
        f"\n(b) debug-moe routing, hidden {args.balance_hidden}, {args.steps} steps: max/mean tokens per expert "
        "(MoE block) and final LM loss"
    )
    print("| load_balance | " + " | ".join(f"step {s}" for s in steps) + " | final LM loss |")
    print("|---|" + "---|" * (len(steps) + 1), flush=True)
    for mode in ("aux_loss", "bias", "none"):
        recs = _records(_train({**base, "model.load_balance": mode}))
        loads = " | ".join(f"{r['expert_load_max_mean']:.2f}" for r in recs)
        print(f"| {mode} | {loads} | {recs[-1]['lm_loss']:.4f} |", flush=True)


def part_ep(args: argparse.Namespace) -> None:
    base = {
        "model.preset": "debug-moe",
        "train.steps": args.ep_steps,
        "train.seq_len": 128,
        "train.global_batch_size": 8,
        "train.eval_batches": 0,
        "metrics.log_interval": args.ep_steps,
        "metrics.report": False,
        "metrics.tensorboard": False,
    }
    print(f"\n(c) debug-moe on 2 ranks (gloo, CPU), {args.ep_steps} steps, batch 8 x 128")
    print("| layout | tokens/s | ep all-to-all bytes (rank 0, last step) | formula | measured / formula |")
    print("|---|---|---|---|---|")
    for name, extra in (("ep=1 (DDP)", {"parallel.ep": 1}), ("ep=2", {"parallel.ep": 2})):
        d = _train({**base, **extra}, nproc=2)
        rec = _records(d)[-1]
        tps = json.loads((d / "summary.json").read_text())["tokens_per_s"]
        a2a = rec["comm_bytes_by_kind"].get("ep", {}).get("all_to_all", 0.0)
        formula = rec.get("ep_a2a_bytes_formula")
        ratio = f"{a2a / formula:.3f}" if formula else "-"
        print(f"| {name} | {tps:,.0f} | {a2a:,.0f} | {f'{formula:,.0f}' if formula else '-'} | {ratio} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("grouped", "balance", "ep", "all"), default="all")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--balance-hidden", type=int, default=64)
    p.add_argument("--ep-steps", type=int, default=30)
    args = p.parse_args()
    if args.part in ("grouped", "all"):
        part_grouped(args)
    if args.part in ("balance", "all"):
        part_balance(args)
    if args.part in ("ep", "all"):
        part_ep(args)


if __name__ == "__main__":
    main()
