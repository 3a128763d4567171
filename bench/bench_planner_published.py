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
RUNS = [  # (name, source, published figure, metric, arguments)
    (
        "Llama 3 405B, 8,192 H100",
        "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4",
        0.43,
        "mfu",
        ["--model", "llama3.1-405b", "--gpus", "8192", "--seq-len", "8192", "--global-batch", "2048"]
        + ["--tp", "8", "--pp", "16", "--dp", "64"],
    ),
    (
        "Llama 3 405B, 16,384 H100",
        "same",
        0.41,
        "mfu",
        ["--model", "llama3.1-405b", "--gpus", "16384", "--seq-len", "8192", "--global-batch", "2048"]
        + ["--tp", "8", "--pp", "16", "--dp", "128"],
    ),
    (
        "GPT 18.4B, 256 A100",
        "Narayanan et al. 2021 (SC21), Table 1",
        135 / 312,
        "hfu",
        GPT
        + ["--layers", "40", "--hidden", "6144", "--heads", "48", "--gpus", "256", "--global-batch", "1024"]
        + ["--tp", "8", "--pp", "1"],
    ),
    (
        "GPT 145.6B, 1,536 A100",
        "same",
        148 / 312,
        "hfu",
        GPT
        + ["--layers", "80", "--hidden", "12288", "--heads", "96", "--gpus", "1536", "--global-batch", "1536"]
        + ["--tp", "8", "--pp", "8", "--schedule", "1f1b"],
    ),
    (
        "GPT 529.6B, 2,520 A100",
        "same",
        163 / 312,
        "hfu",
        GPT
        + ["--layers", "105", "--hidden", "20480", "--heads", "128", "--gpus", "2520", "--global-batch", "2520"]
        + ["--tp", "8", "--pp", "35", "--schedule", "1f1b"],
    ),
    (
        "GPT 1008B, 3,072 A100",
        "same",
        163 / 312,
        "hfu",
        GPT
        + ["--layers", "128", "--hidden", "25600", "--heads", "160", "--gpus", "3072", "--global-batch", "3072"]
        + ["--tp", "8", "--pp", "64", "--schedule", "1f1b"],
    ),
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
