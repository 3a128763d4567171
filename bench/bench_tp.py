"""Tensor parallel vs data parallel on 2 CPU ranks (gloo): step time and bytes on the wire,
with the measured tp bytes against the Megatron-LM figure.

One torchrun world of 2 ranks builds four trainers on the same model, global batch and
data: tp = 2 with and without sequence parallelism, and dp_shard = 2 as DDP (stage 0) and
ZeRO-3. Blocks of steps alternate between them so machine noise hits all four. Each rank
does the same FLOPs in every layout (tp: half of each matmul on the whole batch; dp: whole
matmuls on half the batch); what differs is what crosses the wire:

- tp moves activations: per block and micro-batch, 2 all-reduces of b·s·h in forward and
  2 in backward (Megatron), i.e. 8·(t-1)/t·b·s·h·4 bytes per rank in fp32 -- under SP as
  reduce-scatter + all-gather pairs of the same total -- plus one more pair each way for
  the vocab-parallel embedding and the head's input;
- dp moves gradients: 2·(N-1)/N·4Ψ per step (DDP), 3·(N-1)/N·4Ψ (ZeRO-3 on NCCL; on gloo
  the reduce-scatter runs as an all-reduce, 4·(N-1)/N·4Ψ).

    python bench/bench_tp.py
    python bench/bench_tp.py --hidden 512 --seq-len 256 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_TAG = "RESULT "

LAYOUTS = {
    "tp=2, SP": {"parallel.tp": 2, "parallel.dp_shard": 1},
    "tp=2, no SP": {"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.sequence_parallel": False},
    "dp_shard=2, DDP": {"parallel.dp_shard": 2, "parallel.zero_stage": 0},
    "dp_shard=2, ZeRO-3": {"parallel.dp_shard": 2, "parallel.zero_stage": 3},
}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from meshforge.config import load_config
    from meshforge.guards.preflight import preflight
    from meshforge.models.flops import num_params
    from meshforge.parallel.mesh import build_mesh
    from meshforge.train import Trainer, prepare_run_dir

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    tmp = tempfile.mkdtemp()
    base = {
        "model.hidden": args.hidden,
        "model.layers": args.layers,
        "model.heads": args.hidden // 64,
        "model.kv_heads": 2,
        "model.ffn_hidden": args.hidden * 3,
        "train.seq_len": args.seq_len,
        "train.global_batch_size": args.batch,
        "train.steps": 10**6,
        "train.precision": "fp32",
        "train.device": "cpu",
        "optim.warmup_steps": 0,
        "metrics.console": False,
        "metrics.jsonl": False,
        "metrics.tensorboard": False,
    }
    trainers = {}
    for name, extra in LAYOUTS.items():
        o = {**base, **extra, "run.dir": f"{tmp}/{len(trainers)}"}
        cfg = preflight(load_config(None, o), world)
        mesh = build_mesh(cfg.layout, cfg.train.device)
        if rank == 0:
            prepare_run_dir(cfg)
        dist.barrier()
        trainers[name] = Trainer(cfg, mesh)
    psi = num_params(next(iter(trainers.values())).plan.shape)

    def timed(tr, steps: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            tr.step_once()
        dist.barrier()
        return (time.perf_counter() - t0) / steps

    for tr in trainers.values():
        for _ in range(2):
            tr.step_once()
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.blocks):
        for name, tr in trainers.items():
            times[name].append(timed(tr, args.steps))
    if rank == 0:
        for name, tr in trainers.items():
            comm = tr.measures.extra.get("comm_bytes_by_kind", {})
            row = {"layout": name, "psi": psi, "step": statistics.median(times[name]), "comm": comm}
            print(RESULT_TAG + json.dumps(row), flush=True)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences); one micro-batch per rank")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    fwd = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    out = subprocess.run(cmd + fwd, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"benchmark failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rows = [json.loads(line[len(RESULT_TAG) :]) for line in out.stdout.splitlines() if line.startswith(RESULT_TAG)]
    psi = rows[0]["psi"]
    t, b, s, h, L = 2, args.batch, args.seq_len, args.hidden, args.layers
    act = b * s * h * 4
    megatron_blocks = L * 8 * (t - 1) / t * act
    edges = 4 * (t - 1) / t * act
    print(
        f"model: {psi / 1e6:.2f}M parameters (Ψ), hidden {h}, {L} layers; global batch {b} x {s} tokens; "
        f"fp32, gloo, 2 ranks, {os.cpu_count()} cores"
    )
    print(f"Megatron figure for tp = 2: {L} blocks x 8·(t-1)/t·b·s·h·4 = {megatron_blocks / 1e6:.2f} MB")
    print(f"  + embedding and head input (one all-reduce equivalent each way) = {edges / 1e6:.2f} MB")
    print()
    print(f"{'layout':<20} {'step (s)':>9} {'vs DDP':>7} {'tp MB':>8} {'tp/formula':>10} {'dp MB':>8}  kinds")
    ddp = next(r["step"] for r in rows if r["layout"].endswith("DDP"))
    for r in rows:
        comm = r["comm"]
        tp = sum(comm.get("tp", {}).values())
        dp = sum(v for axis, kinds in comm.items() if axis != "tp" for v in kinds.values())
        ratio = f"{tp / (megatron_blocks + edges):.4f}" if tp else "-"
        kinds = "; ".join(
            f"{axis}: " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in kv.items()) for axis, kv in comm.items()
        )
        print(
            f"{r['layout']:<20} {r['step']:>9.3f} {r['step'] / ddp:>6.2f}x {tp / 1e6:>8.2f} {ratio:>10} "
            f"{dp / 1e6:>8.2f}  {kinds}"
        )
    print(
        "\ntp/formula: measured tp-axis bytes over the Megatron figure plus the embedding/head pair; "
        "above 1 only by the loss-parallel statistics (b·s floats) and norm-weight gradients (h floats)."
    )


if __name__ == "__main__":
    main()
