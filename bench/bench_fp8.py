"""What fp8 costs in quality: the debug preset trained on the same data in bf16 and in fp8
(torchao, tensorwise and rowwise recipes), and per-module errors for one batch.

1. Loss over training: three runs from the same seed and data (meshforge train, one process);
   the table gives each fp8 run's loss and its gap to bf16 at a few steps, and the mean gap
   over the last 10% of steps.
2. Per module, for one batch of the bf16 model: every linear layer's input and output
   gradient are recorded in a bf16 forward/backward, then the layer alone is run again in
   bf16 and as a torchao Float8Linear on exactly those tensors; the table gives
   ||fp8 - bf16|| / ||bf16|| of its output and of its weight gradient (the error fp8 adds
   at that layer, not compounded through the layers before it).

On a CPU torchao emulates fp8 (the same numerics, no speed-up); on a GPU with compute
capability >= 8.9 the matmuls are real fp8.

    python bench/bench_fp8.py                  # 100 steps of the debug preset, seq 128
    python bench/bench_fp8.py --steps 300 --seq-len 256
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

from meshforge.config import load_config
from meshforge.data.corpus import open_data
from meshforge.guards.preflight import preflight
from meshforge.models.llama import build_model
from meshforge.parallel.fp8 import DEFAULT_EXCLUDE, fp8_config, fp8_plan, require_torchao
from meshforge.parallel.precision import autocast
from meshforge.resolve import resolve
from meshforge.train.loop import train
from meshforge.train.run_dir import prepare_run_dir

RUNS = (("bf16", "tensorwise"), ("fp8", "tensorwise"), ("fp8", "rowwise"))


def overrides(args: argparse.Namespace, precision: str, recipe: str, run_dir: str) -> dict:
    return {
        "model.preset": "debug",
        "train.steps": args.steps,
        "train.seq_len": args.seq_len,
        "train.global_batch_size": args.batch,
        "train.precision": precision,
        "train.fp8_recipe": recipe,
        "train.device": "auto",
        "train.eval_batches": 0,
        "metrics.log_interval": 1,
        "metrics.console": False,
        "metrics.tensorboard": False,
        "metrics.report": False,
        "checkpoint.save_final": False,
        "run.dir": run_dir,
    }


def loss_curves(args: argparse.Namespace, tmp: str) -> dict[str, list[float]]:
    curves = {}
    for precision, recipe in RUNS:
        name = precision if precision == "bf16" else f"fp8 {recipe}"
        d = f"{tmp}/{precision}-{recipe}"
        plan = preflight(load_config(None, overrides(args, precision, recipe, d)), 1)  # as `meshforge train` does
        prepare_run_dir(plan)
        train(plan)
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [r["loss"] for r in rows]
    return curves


def print_curves(curves: dict[str, list[float]]) -> None:
    base = curves["bf16"]
    n = len(base)
    marks = sorted({1, *(s for s in (10, 25, 50, 100, 200, 300, 500) if s < n), n})
    names = [k for k in curves if k != "bf16"]
    print(f"{'step':>5} | {'bf16 loss':>9} | " + " | ".join(f"{k:>14} {'gap':>7}" for k in names))
    for s in marks:
        cells = [f"{curves[k][s - 1]:14.4f} {100 * (curves[k][s - 1] / base[s - 1] - 1):+6.2f}%" for k in names]
        print(f"{s:>5} | {base[s - 1]:9.4f} | " + " | ".join(cells))
    tail = max(1, n // 10)
    for k in names:
        gap = sum(curves[k][-tail:]) / sum(base[-tail:]) - 1
        print(f"mean gap of {k} over the last {tail} steps: {100 * gap:+.2f}%")


def record_linears(model: nn.Module, tokens: torch.Tensor, device: torch.device) -> dict[str, tuple]:
    """Each linear's input and output gradient in one bf16 forward/backward of ``model``."""
    seen: dict[str, list] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            seen[name] = [None, None]
            hooks.append(mod.register_forward_hook(lambda m, i, o, n=name: seen[n].__setitem__(0, i[0].detach())))
            hooks.append(
                mod.register_full_backward_hook(lambda m, gi, go, n=name: seen[n].__setitem__(1, go[0].detach()))
            )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=device)
    with autocast(device, "bf16"):
        logits = model(inputs, positions)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    for h in hooks:
        h.remove()
    return {k: (v[0], v[1]) for k, v in seen.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def module_errors(args: argparse.Namespace, device: torch.device) -> list[tuple[str, float, float, float, float]]:
    """(module, out err tensorwise, grad err tensorwise, out err rowwise, grad err rowwise)."""
    require_torchao()
    from torchao.float8.float8_linear import Float8Linear

    plan = resolve(load_config(None, overrides(args, "bf16", "tensorwise", tempfile.mkdtemp())), 1)
    model_args = plan.shape
    model = build_model(model_args, device=str(device), seed=0)
    data = open_data(plan, model_args)
    tokens = data.train.get(list(range(args.batch))).to(device)
    recorded = record_linears(model, tokens, device)
    plan = fp8_plan(model, [])  # every linear whose shape fp8 takes, the head included
    default_out = fp8_plan(model, list(DEFAULT_EXCLUDE)).excluded
    rows = []
    for name in plan.converted:
        x, g = recorded[name]
        base = model.get_submodule(name)
        outs = {}
        for recipe in ("bf16", "tensorwise", "rowwise"):
            lin = copy.deepcopy(base)
            lin.weight.grad = None
            if recipe != "bf16":
                lin = Float8Linear.from_float(lin, config=fp8_config(recipe, device, gathers=False))
            xi = x.clone().requires_grad_(False)
            with autocast(device, "bf16"):
                y = lin(xi)
            y.backward(g.to(y.dtype))
            outs[recipe] = (y.detach(), lin.weight.grad.detach())
        (yb, gb), (yt, gt), (yr, gr) = outs["bf16"], outs["tensorwise"], outs["rowwise"]
        label = name + (" *" if name in default_out else "")
        rows.append((label, _rel(yt, yb), _rel(gt, gb), _rel(yr, yb), _rel(gr, gb)))
    return rows


def print_module_errors(rows: list[tuple[str, float, float, float, float]]) -> None:
    head = f"{'out tensorwise':>14} {'wgrad tensorwise':>16} | {'out rowwise':>11} {'wgrad rowwise':>13}"
    print(f"{'module':<28} | {head}")
    for name, ot, gt, orow, grow in rows:
        print(f"{name:<28} | {ot:14.2e} {gt:16.2e} | {orow:11.2e} {grow:13.2e}")
    print("* kept in bf16 by the default train.fp8_exclude; shown for comparison")
    for i, what in ((1, "out tensorwise"), (2, "wgrad tensorwise"), (3, "out rowwise"), (4, "wgrad rowwise")):
        vals = [r[i] for r in rows]
        print(f"{what}: median {sorted(vals)[len(vals) // 2]:.2e}, max {max(vals):.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--skip-training", action="store_true", help="only the per-module table")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dataclasses.asdict(resolve(load_config(None, {"model.preset": "debug"}), 1).shape)
    print(
        f"debug preset (hidden {shape['hidden']}, {shape['layers']} layers, ffn {shape['ffn_hidden']}), "
        f"{args.batch} x {args.seq_len} tokens per step, {device.type}"
        + (" (fp8 emulated: numerics only)" if device.type == "cpu" else "")
    )
    if not args.skip_training:
        with tempfile.TemporaryDirectory() as tmp:
            print_curves(loss_curves(args, tmp))
    print()
    print_module_errors(module_errors(args, device))


if __name__ == "__main__":
    main()
