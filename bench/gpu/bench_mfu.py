"""MFU on one GPU: meshforge's training of Llama 3.2 1B/3B against the physical limit, the
planner's prediction and torchtitan, side by side in one run.

For each configuration this trains with ``meshforge train`` (default corpus, bf16, one GPU,
no evaluation or checkpoints), reads the run's summary (tokens/s, MFU, HFU, peak memory,
steady-state step time), asks the planner for exactly that run's config (the prediction the
run report shows), and -- when ``bench/gpu/bench_torchtitan.py`` is present and torchtitan
imports -- trains the same shape under torchtitan and prints tokens/s as a ratio.

    python bench/gpu/bench_mfu.py --out bench/gpu/out/mfu.md        # the suite's table
    python bench/gpu/bench_mfu.py --only 1b-4096-compile             # one row
    python bench/gpu/bench_mfu.py --smoke                            # CPU: debug preset, checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    seq_len: int
    compile: bool
    ac: str  # activation checkpointing: none | selective | full
    global_batch: int
    micro_batch: int
    steps: int = 30

    def overrides(self) -> list[str]:
        return [
            f"--model.preset={self.preset}",
            f"--model.max_seq_len={self.seq_len}",
            f"--train.seq_len={self.seq_len}",
            f"--train.global_batch_size={self.global_batch}",
            f"--train.micro_batch_size={self.micro_batch}",
            f"--train.compile={str(self.compile).lower()}",
            f"--train.activation_checkpoint={self.ac}",
            f"--train.steps={self.steps}",
            "--train.eval_batches=0",
            "--optim.warmup_steps=5",
            "--metrics.log_interval=10",
            "--metrics.report=false",
            "--metrics.tensorboard=false",
            "--checkpoint.save_final=false",
        ]


CASES = [
    Case("1b-4096-eager", "llama3.2-1b", 4096, False, "none", 16, 2),
    Case("1b-4096-compile", "llama3.2-1b", 4096, True, "none", 16, 2),
    Case("1b-8192-eager", "llama3.2-1b", 8192, False, "none", 8, 1),
    Case("1b-8192-compile", "llama3.2-1b", 8192, True, "none", 8, 1),
    Case("3b-4096-ac-compile", "llama3.2-3b", 4096, True, "full", 16, 2),
    Case("3b-8192-ac-compile", "llama3.2-3b", 8192, True, "full", 8, 1),
]
SMOKE = Case("smoke", "debug", 128, False, "none", 8, 4, steps=12)


def run_meshforge(case: Case, device: str, work: Path) -> dict:
    """Train ``case`` and return its summary, steady step time and the planner's prediction."""
    run = work / case.name
    cmd = [sys.executable, "-m", "meshforge", "train", *case.overrides(), f"--train.device={device}"]
    cmd += [f"--run.dir={run}", "--run.overwrite=true"]
    if device == "cpu":
        cmd.append("--train.precision=fp32")
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-1500:]}
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steady = [x["step_time_s"] for x in recs[len(recs) // 2 :]] or [x["step_time_s"] for x in recs]
    summary["step_time_s"] = sorted(steady)[len(steady) // 2]
    summary["prediction"] = predict(run)
    return summary


def predict(run: Path) -> dict | str:
    """The planner's estimate for the run's own config.toml (the run report's prediction)."""
    sys.path.insert(0, str(ROOT / "src"))
    from meshforge.report.run_report import load_run
    from meshforge.report.run_report import predict as report_predict

    return report_predict(load_run(run))


def run_torchtitan(case: Case, device: str) -> dict | None:
    """torchtitan on the same shape, or None where its bench or torchtitan is missing."""
    script = ROOT / "bench" / "gpu" / "bench_torchtitan.py"
    if not script.is_file():
        return None
    if device == "cpu":
        args = [sys.executable, str(script), "--smoke"]
    else:  # torchtitan has no accumulation: one micro-batch per step, the same tokens per forward
        args = [sys.executable, str(script), "--model", case.preset, "--seq-len", str(case.seq_len)]
        args += ["--micro-batch", str(case.micro_batch), "--precision", "bf16", "--ac", case.ac]
        args += ["--steps", "13", "--warmup", "3", "--compile" if case.compile else "--no-compile"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode and device != "cpu":  # CUDA graphs or its compile may not work on this torch
        r = subprocess.run([*args, "--no-cuda-graphs"], capture_output=True, text=True, env=env)
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-800:]}
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": "no JSON line in its output"}


def row(case: Case, m: dict, tt: dict | None) -> str:
    if "error" in m:
        return f"| {case.name} | failed: {m['error'].splitlines()[-1][:120]} |"
    p = m["prediction"]
    pt = f"{p['step_time_s'] / m['step_time_s']:.2f}" if isinstance(p, dict) else "-"
    pm = f"{p['mem_gib'] / m['peak_mem_gib']:.2f}" if isinstance(p, dict) and m["peak_mem_gib"] else "-"
    if tt is None:
        ttc = "not run"
    elif "error" in tt:
        ttc = "failed: " + tt["error"].splitlines()[-1][:80]
    else:
        ttc = f"{tt['tokens_per_s']:,.0f} ({m['tokens_per_s'] / tt['tokens_per_s']:.2f}x)"
    return (
        f"| {case.name} | {m['tokens_per_s']:,.0f} | {100 * m['mfu']:.1f}% | {100 * m['hfu']:.1f}% | "
        f"{m['peak_mem_gib']:.1f} | {m['step_time_s'] * 1e3:.0f} | {pt} | {pm} | {ttc} |"
    )


HEADER = (
    "| config | tok/s | MFU | HFU | peak GiB | step ms | planner time / measured | planner mem / measured "
    "| torchtitan tok/s (meshforge / torchtitan) |\n|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    ap.add_argument("--only", nargs="*", help="run only these cases: " + ", ".join(c.name for c in CASES))
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on the debug preset")
    ap.add_argument("--no-torchtitan", action="store_true")
    a = ap.parse_args(argv)
    cases = [SMOKE] if a.smoke else [c for c in CASES if not a.only or c.name in a.only]
    device = "cpu" if a.smoke else "cuda"
    lines = [HEADER]
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            m = run_meshforge(c, device, Path(tmp))
            tt = None if a.no_torchtitan or "error" in m else run_torchtitan(c, device)
            lines.append(row(c, m, tt))
            print(lines[-1], flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(lines) + "\n")
    return 0 if all("failed" not in x for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
