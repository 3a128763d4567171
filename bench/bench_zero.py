"""Data-parallel stages side by side on CPU/gloo: memory against the ZeRO formulas, step time
against DeepSpeed.

For N in {2, 4} ranks (started here through torchrun) and one model and data:

1. per-rank state memory of meshforge stages 0-3, counted from the tensors, divided by
   the formula of meshforge's accounting (fp32 master weights, grads and Adam m, v):
   16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 16Ψ/N (incl. the parameters kept gathered fwd -> bwd), 16Ψ/N.
   The ZeRO paper's mixed-precision figures (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N) are
   printed beside them: they keep fp16 params/grads plus an fp32 master copy inside the
   optimizer state, so only stages 0 and 3 coincide with fp32 training;
2. step time of every stage, and of DeepSpeed ZeRO-2 and ZeRO-3 (CPU accelerator, gloo,
   torch AdamW) on the same model, batch and data; blocks of steps alternate between
   meshforge and DeepSpeed so machine noise hits both.

    python bench/bench_zero.py                    # N = 2 and 4
    python bench/bench_zero.py --nproc 2 --hidden 384
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_TAG = "RESULT "


def formulas(stage: int, n: int, precision: str = "fp32") -> tuple[float, float]:
    """(meshforge's accounting at ``precision``, ZeRO paper mixed precision) in bytes per parameter.
    bf16: stage 0 is autocast over fp32 weights; stage 1 holds the paper's bytes (parallel/data/zero1.py);
    stages 2/3 keep fp32 shards and gather bf16 copies (2Ψ kept gathered fwd -> bwd under stage 2)."""
    ours = {0: 16, 1: 8 + 8 / n, 2: 4 + 16 / n, 3: 16 / n}[stage]
    if precision == "bf16":
        ours = {0: 16, 1: 4 + 12 / n, 2: 2 + 16 / n, 3: 16 / n}[stage]
    paper = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return ours, paper


def build_trainers(args: argparse.Namespace, world: int, rank: int) -> dict:
    """One Trainer per ZeRO stage, same model, data and batch."""
    import torch.distributed as dist

    from meshforge.config import load_config
    from meshforge.guards.preflight import preflight
    from meshforge.parallel.mesh import build_mesh
    from meshforge.train import Trainer, prepare_run_dir

    tmp = tempfile.mkdtemp()
    base = {
        "model.hidden": args.hidden, "model.layers": args.layers, "model.heads": args.hidden // 64,
        "model.kv_heads": max(1, args.hidden // 128), "model.ffn_hidden": args.hidden * 3,
        "train.seq_len": args.seq_len, "train.global_batch_size": args.micro * world, "train.steps": 10**6,
        "train.precision": args.precision, "train.device": "cpu", "optim.warmup_steps": 0,
        "metrics.console": False, "metrics.jsonl": False, "metrics.tensorboard": False,
    }  # fmt: skip
    trainers = {}
    for stage in range(4):
        o = {**base, "parallel.zero_stage": stage, "run.dir": f"{tmp}/s{stage}"}
        cfg = preflight(load_config(None, o), world)  # the corpus is cached after the first rank builds it
        mesh = build_mesh(cfg.layout, cfg.train.device)
        if rank == 0:
            prepare_run_dir(cfg)
        dist.barrier()
        trainers[stage] = Trainer(cfg, mesh)
    return trainers


def ds_engine(args: argparse.Namespace, stage: int, trainers: dict, world: int):
    """A DeepSpeed ZeRO-``stage`` step on the same model, batch and data (the stage's sampler)."""
    import deepspeed
    import torch.nn.functional as F

    from meshforge.models.llama import build_model

    model = build_model(trainers[0].plan.shape, device="cpu", seed=0)
    adamw = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True}
    config = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": adamw},
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tr = trainers[stage]

    def step():
        idx = tr.state.sampler.next_batch(tr.mesh.dp_rank, world)
        batch = tr.data.train.get(idx)
        logits = engine(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        engine.backward(loss)
        engine.step()

    return step


def timed(fn, steps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def measure_stage(args: argparse.Namespace, stage: int, trainers: dict, world: int, psi: int) -> dict:
    """Memory, comm and step time of one stage (and DeepSpeed's, stages 2 and 3), in alternating blocks."""
    tr = trainers[stage]
    for _ in range(2):
        tr.step_once()
    mem = sum(tr.state_mem.values())
    ours, paper = formulas(stage, world, args.precision)
    ds_step = None
    if stage in (2, 3) and not args.no_deepspeed:
        ds_step = ds_engine(args, stage, trainers, world)
        for _ in range(2):
            ds_step()
    t_mf, t_ds = [], []
    for _ in range(args.blocks):
        t_mf.append(timed(tr.step_once, args.steps))
        if ds_step:
            t_ds.append(timed(ds_step, args.steps))
    return {
        "n": world, "stage": stage, "psi": psi, "mem": mem, "ours": ours * psi, "paper": paper * psi,
        "step": statistics.median(t_mf), "ds": statistics.median(t_ds) if t_ds else None,
        "comm": sum(sum(k.values()) for k in tr.measures.extra.get("comm_bytes_by_kind", {}).values()),
    }  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import json

    import torch.distributed as dist

    from meshforge.models.flops import num_params

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trainers = build_trainers(args, world, rank)
    psi = num_params(trainers[0].plan.shape)
    results = [measure_stage(args, stage, trainers, world, psi) for stage in trainers]
    if rank == 0:
        for r in results:
            print(RESULT_TAG + json.dumps(r), flush=True)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import json

    rows = []
    for n in args.nproc:
        keys = ("hidden", "layers", "seq_len", "micro", "blocks", "steps", "precision")
        fwd = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
        fwd += ["--no-deepspeed"] if args.no_deepspeed else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__]
        cmd += ["--worker", *fwd]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"N={n} failed:\n{out.stderr[-4000:]}")
        rows += [json.loads(line[len(RESULT_TAG) :]) for line in out.stdout.splitlines() if line.startswith(RESULT_TAG)]
    psi = rows[0]["psi"]
    print(
        f"model: {psi / 1e6:.2f}M parameters (Ψ), hidden {args.hidden}, {args.layers} layers, "
        f"{args.micro} x {args.seq_len} tokens per rank per step, {args.precision}, gloo"
    )
    print(
        f"{'N':>2} {'stage':>5} | {'state MiB':>9} | {'formula':>11} {'ratio':>6} | {'ZeRO paper':>10} | "
        f"{'step s':>7} | {'DeepSpeed s':>11} | {'DS/ours':>7} | {'comm MiB':>8}"
    )
    for r in rows:
        ds = f"{r['ds']:11.3f} | {r['ds'] / r['step']:6.3f}x" if r["ds"] else f"{'-':>11} | {'-':>7}"
        print(
            f"{r['n']:>2} {r['stage']:>5} | {r['mem'] / 2**20:9.2f} | {r['ours'] / 2**20:8.2f}MiB "
            f"{r['mem'] / r['ours']:6.3f} | {r['paper'] / 2**20:7.2f}MiB | {r['step']:7.3f} | {ds} | "
            f"{r['comm'] / 2**20:8.2f}"
        )
    print("ratio: measured / formula (target within 5%); DS/ours > 1: meshforge faster (target >= 1)")


if __name__ == "__main__":
    main()
