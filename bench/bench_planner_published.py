"""Planner predictions against published large runs (the validation table in docs/planner.md).

Each run is planned from its published model, cluster and parallel degrees, with hardware
from the presets; what the paper does not report (micro-batch, ZeRO stage, schedule) is
searched. No constant is fitted to these runs. Pure modelling: seconds, no GPU.

    python bench/bench_planner_published.py
"""

from __future__ import annotations

import json
import subprocess
import sys

GPT = ["--mlp", "gelu", "--vocab", "51200", "--seq-len", "2048", "--gpu", "a100-80g", "--recompute", "full"]
NARAYANAN = "Narayanan et al. 2021 (SC21), Table 1"
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4"


def llama405b(gpus: int, dp: int) -> list[str]:
    return ["--model", "llama3.1-405b", "--gpus", str(gpus), "--seq-len", "8192", "--global-batch", "2048"] + [
        "--tp",
        "8",
        "--pp",
        "16",
        "--dp",
        str(dp),
    ]


def gpt(layers: int, hidden: int, heads: int, gpus: int, batch: int, pp: int) -> list[str]:
    """Megatron-LM's GPT runs: tp 8, 1F1B when pipelined."""
    shape = ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads)]
    degrees = ["--tp", "8", "--pp", str(pp)] + (["--schedule", "1f1b"] if pp > 1 else [])
    return GPT + shape + ["--gpus", str(gpus), "--global-batch", str(batch)] + degrees


RUNS = [  # (name, source, published figure, metric, arguments)
    ("Llama 3 405B, 8,192 H100", LLAMA3, 0.43, "mfu", llama405b(8192, 64)),
    ("Llama 3 405B, 16,384 H100", LLAMA3, 0.41, "mfu", llama405b(16384, 128)),
    ("GPT 18.4B, 256 A100", NARAYANAN, 135 / 312, "hfu", gpt(40, 6144, 48, 256, 1024, 1)),
    ("GPT 145.6B, 1,536 A100", NARAYANAN, 148 / 312, "hfu", gpt(80, 12288, 96, 1536, 1536, 8)),
    ("GPT 529.6B, 2,520 A100", NARAYANAN, 163 / 312, "hfu", gpt(105, 20480, 128, 2520, 2520, 35)),
    ("GPT 1008B, 3,072 A100", NARAYANAN, 163 / 312, "hfu", gpt(128, 25600, 160, 3072, 3072, 64)),
]


def main() -> None:
    print(f"{'run':<28} {'layout':<34} {'published':>9} {'predicted':>9} {'pred/pub':>8}")
    for name, _source, published, metric, argv in RUNS:
        cmd = [sys.executable, "-m", "meshforge", "plan", *argv, "--top", "1", "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{name}: {r.stderr.strip()}")
        e = json.loads(r.stdout)["layouts"][0]
        lay = f"tp {e['tp']} pp {e['pp']} dp {e['dp']} mb {e['micro_batch_size']}"
        if e["pp"] > 1:
            lay += f" {e['schedule']}" + (f" v{e['virtual_stages']}" if e["virtual_stages"] > 1 else "")
        pred = e[metric]
        ratio = pred / published
        print(f"{name:<28} {lay:<34} {100 * published:>7.1f}% {100 * pred:>7.1f}% {ratio:>8.2f}  ({metric.upper()})")


if __name__ == "__main__":
    main()
