"""Training-step speed, side by side in one run, on the same shape, batch and precision.

(a) a meshforge training step (Trainer.step_once: LR schedule, data from the memory-mapped
    shards, forward, loss, backward, clipping, AdamW) against a minimal hand-written
    PyTorch loop over the same model with a batch already in memory — target >= 0.97x;
(b) the meshforge model against transformers' LlamaForCausalLM, both doing
    forward + cross-entropy + backward + AdamW — target >= 1.0x.

Ratios are speed ratios (>1: meshforge faster). Blocks of steps alternate between the
two sides so drift in machine load hits both; the median block time is used.

    python bench/bench_step.py                 # fp32 and bf16, CPU
    python bench/bench_step.py --precision fp32 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from meshforge.config import load_config
from meshforge.guards.preflight import preflight
from meshforge.models.llama import build_model
from meshforge.parallel.mesh import Mesh
from meshforge.parallel.precision import autocast
from meshforge.train import Trainer, prepare_run_dir


def alternate(fa, fb, blocks: int, steps: int) -> tuple[float, float]:
    """Median seconds per step of fa and fb, measured in alternating blocks after a warm-up."""
    for _ in range(2):
        fa()
        fb()
    ta, tb = [], []
    for _ in range(blocks):
        for f, out in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            for _ in range(steps):
                f()
            out.append((time.perf_counter() - t0) / steps)
    return statistics.median(ta), statistics.median(tb)


def make_trainer(args, precision: str, run_dir: str) -> Trainer:
    cfg = load_config(
        None,
        {
            "model.hidden": args.hidden,
            "model.layers": args.layers,
            "model.heads": args.hidden // 64,
            "model.kv_heads": max(1, args.hidden // 128),
            "model.ffn_hidden": int(args.hidden * 8 / 3) // 64 * 64,
            "train.seq_len": args.seq_len,
            "train.global_batch_size": args.batch,
            "train.steps": 10**6,
            "train.precision": precision,
            "train.device": "cpu",
            "metrics.console": False,
            "metrics.jsonl": False,
            "metrics.tensorboard": False,
            "run.dir": run_dir,
            "optim.warmup_steps": 0,
        },
    )
    cfg = preflight(cfg, 1)
    prepare_run_dir(cfg)
    return Trainer(cfg, Mesh(0, 1, 0, torch.device("cpu")))


def bench(args, precision: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tr = make_trainer(args, precision, tmp)
        a = tr.plan.shape
        device = torch.device("cpu")
        batch = tr.data.train.get(list(range(args.batch))).to(device)
        x, y = batch[:, :-1], batch[:, 1:]

        # (a) a hand-written loop over a second copy of the same model
        plain = build_model(a, device=device, seed=0)
        popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

        def hand_step(model=plain, opt=popt):
            with autocast(device, precision):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t_mf, t_hand = alternate(tr.step_once, hand_step, args.blocks, args.steps)
        out = {"precision": precision, "meshforge_step_s": t_mf, "hand_loop_s": t_hand, "ratio_a": t_hand / t_mf}

        # (b) transformers' LlamaForCausalLM with the same shape and weights
        try:
            import transformers
        except ImportError:
            return out
        from meshforge.models.hf import hf_config_from_args, to_hf_name

        hcfg = hf_config_from_args(a, torch.float32)
        hcfg.pop("architectures")
        hcfg.pop("model_type")
        hcfg.pop("torch_dtype")
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hcfg, attn_implementation="sdpa"))
        hf.load_state_dict({to_hf_name(k): v for k, v in plain.state_dict().items()})
        hopt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

        def hf_step():
            with autocast(device, precision):
                logits = hf(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0, foreach=True)
            hopt.step()
            hopt.zero_grad(set_to_none=True)

        t_ours, t_hf = alternate(hand_step, hf_step, args.blocks, args.steps)
        out.update({"model_step_s": t_ours, "hf_step_s": t_hf, "ratio_b": t_hf / t_ours})
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    print(
        f"shape: hidden {args.hidden}, layers {args.layers}, batch {args.batch} x {args.seq_len}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'precision':>9} | {'meshforge step':>14} | {'hand loop':>9} | {'(a) ratio':>9} | "
        f"{'mf model':>9} | {'HF Llama':>9} | {'(b) ratio':>9}"
    )
    for prec in precisions:
        r = bench(args, prec)
        b = (
            f"{r['model_step_s'] * 1e3:7.1f}ms | {r['hf_step_s'] * 1e3:7.1f}ms | {r['ratio_b']:8.3f}x"
            if "ratio_b" in r
            else "transformers not installed"
        )
        print(
            f"{prec:>9} | {r['meshforge_step_s'] * 1e3:12.1f}ms | {r['hand_loop_s'] * 1e3:7.1f}ms | "
            f"{r['ratio_a']:8.3f}x | {b}"
        )
    print("(a) target >= 0.97x, (b) target >= 1.0x; ratio = other's time / meshforge's time")


if __name__ == "__main__":
    main()
