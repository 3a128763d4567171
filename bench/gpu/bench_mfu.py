"""MFU on one GPU: meshforge's training against the physical limit, the planner's prediction and
torchtitan's single-GPU recipe (bench_torchtitan.py), side by side in one run, with a one-step
profile summary per side (trace_summary.py) and a kernel-by-kernel diff of the two traced steps
(kernel_diff.py, one report per row into ``--kdiff-out``). Rows are grouped in parts (run.sh part2..part6).

For each configuration this trains with ``meshforge train`` (default corpus, bf16, one GPU,
no evaluation or checkpoints), reads the run's summary (tokens/s, MFU, HFU, peak memory,
steady-state step time), asks the planner for exactly that run's config (the prediction the
run report shows), and -- when ``bench/gpu/bench_torchtitan.py`` is present and torchtitan
imports -- trains the same shape under torchtitan and prints tokens/s as a ratio.

    python bench/gpu/bench_mfu.py --out bench/gpu/out/mfu.md        # the suite's table
    python bench/gpu/bench_mfu.py --only 1b-4096-compile             # one row
    python bench/gpu/bench_mfu.py --part 3 --out $OUT/mfu-part3.md --kdiff-out $OUT/kdiff-part3.md
    python bench/gpu/bench_mfu.py --smoke                            # CPU: debug preset, checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
from kernel_diff import TraceError, compare  # noqa: E402
from trace_summary import short, summarize  # noqa: E402

# the peer needs meshforge and the carried wheels (run.sh puts them on PYTHONPATH)
# one device command may run 10 minutes: a part stops starting runs after PART_BUDGET_S (env overrides)
SIDE_TIMEOUT_S = int(os.environ.get("SIDE_TIMEOUT_S", "270"))
PART_BUDGET_S = int(os.environ.get("PART_BUDGET_S", "480"))
DEADLINE = time.monotonic() + PART_BUDGET_S
PYPATH = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    seq_len: int
    compile: bool
    ac: str  # activation checkpointing: none | selective | full
    global_batch: int
    micro_batch: int
    part: int = 2  # bench/gpu/run.sh partN runs the cases of part N
    fp8: bool = False
    offload: bool = False
    steps: int = 16

    def overrides(self) -> list[str]:
        o = [
            f"--model.preset={self.preset}",
            f"--model.max_seq_len={self.seq_len}",
            f"--train.seq_len={self.seq_len}",
            f"--train.global_batch_size={self.global_batch}",
            f"--train.micro_batch_size={self.micro_batch}",
            f"--train.compile={str(self.compile).lower()}",
            f"--train.activation_checkpoint={self.ac}",
            f"--train.steps={self.steps}",
            "--train.eval_batches=0",
            "--optim.warmup_steps=2",
            "--metrics.log_interval=4",
            "--metrics.report=false",
            "--metrics.tensorboard=false",
            "--checkpoint.save_final=false",
            f"--profile.start_step={self.steps - 1}",  # one unlogged step near the end, traced
            "--profile.steps=1",
            "--profile.memory=false",  # no allocation stacks: the traced step's host side as the peer's
        ]
        o += ["--train.precision=fp8"] if self.fp8 else []
        return o + (["--parallel.offload=cpu"] if self.offload else [])

    def peer_args(self) -> list[str]:
        """The same shape, tokens per optimizer step, precision, compile, AC, fp8 and offload."""
        a = ["--model", self.preset, "--seq-len", str(self.seq_len), "--micro-batch", str(self.micro_batch)]
        a += ["--accum", str(self.global_batch // self.micro_batch), "--ac", "full" if self.ac == "full" else "none"]
        a += ["--steps", str(max(4, self.steps // 2)), "--warmup", "2", "--compile" if self.compile else "--no-compile"]
        return a + (["--fp8"] if self.fp8 else []) + (["--offload"] if self.offload else [])


# part 1 of run.sh is the CUDA tests; the parts below are each sized to stay under 8 minutes on one H100
CASES = [
    Case("1b-4096-eager", "llama3.2-1b", 4096, False, "none", 16, 2, part=2),
    Case("1b-4096-compile", "llama3.2-1b", 4096, True, "none", 16, 2, part=2),
    Case("1b-32k-ac-compile", "llama3.2-1b", 32768, True, "full", 1, 1, part=3, steps=12),
    Case("1b-64k-ac-compile", "llama3.2-1b", 65536, True, "full", 1, 1, part=3, steps=8),
    Case("3b-8192-ac-compile", "llama3.2-3b", 8192, True, "full", 4, 1, part=4, steps=12),
    Case("3b-8192-ac-eager", "llama3.2-3b", 8192, False, "full", 4, 1, part=4, steps=8),
    Case("1b-4096-fp8-compile", "llama3.2-1b", 4096, True, "none", 16, 2, part=5, fp8=True),
    Case("3b-4096-fp8-ac-compile", "llama3.2-3b", 4096, True, "full", 8, 2, part=5, fp8=True, steps=12),
    Case("8b-4096-offload-eager", "llama3.1-8b", 4096, False, "none", 2, 1, part=6, offload=True, steps=6),
]
SMOKE = Case("smoke", "debug", 128, False, "none", 8, 4, steps=12)


def run_side(cmd: list[str]) -> subprocess.CompletedProcess:
    """One side of a row, killed after SIDE_TIMEOUT_S so one hang cannot eat a part's device time."""
    limit = int(min(SIDE_TIMEOUT_S, DEADLINE - time.monotonic()))
    if limit < 30:
        return subprocess.CompletedProcess(cmd, 124, "", f"the part's time budget ({PART_BUDGET_S} s) is spent")
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYPATH}, timeout=limit
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {limit} s")


def host_memory_short(case: Case) -> str:
    """Offload keeps fp32 weights, gradients and Adam's two moments in host memory (16 bytes per
    parameter): say so instead of letting the kernel's OOM killer end the whole part."""
    if not case.offload:
        return ""
    sys.path.insert(0, str(ROOT / "src"))
    from meshforge.models import flops
    from meshforge.models.presets import get_preset

    need = 16 * flops.num_params(get_preset(case.preset)) / 2**30
    avail = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in x)
    have = avail / 2**20
    return f"needs ~{need:.0f} GiB host memory for offloaded state, {have:.0f} GiB available" if have < need else ""


def run_meshforge(case: Case, device: str, work: Path) -> dict:
    """Train ``case`` and return its summary, steady step time, profile and the planner's prediction."""
    run = work / case.name
    cmd = [sys.executable, "-m", "meshforge", "train", *case.overrides(), f"--train.device={device}"]
    cmd += [f"--run.dir={run}", "--run.overwrite=true"]
    if device == "cpu":
        cmd.append("--train.precision=fp32")
    r = run_side(cmd)
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-1500:]}
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steady = [x["step_time_s"] for x in recs[len(recs) // 2 :]] or [x["step_time_s"] for x in recs]
    summary["step_time_s"] = sorted(steady)[len(steady) // 2]
    summary["prediction"] = predict(run)
    traces = sorted((run / "profile").glob("rank-*.json"))
    summary["profile"] = summarize(traces[0]) if traces else None
    summary["trace"] = str(traces[0]) if traces else ""
    return summary


def predict(run: Path) -> dict | str:
    """The planner's estimate for the run's own config.toml (the run report's prediction)."""
    sys.path.insert(0, str(ROOT / "src"))
    from meshforge.report.run_report import load_run
    from meshforge.report.run_report import predict as report_predict

    return report_predict(load_run(run))


def run_torchtitan(case: Case, device: str, work: Path) -> dict | None:
    """The peer on the same shape and tokens per optimizer step, or None where its script is missing."""
    script = ROOT / "bench" / "gpu" / "bench_torchtitan.py"
    if not script.is_file():
        return None
    args = [sys.executable, str(script)]
    args += ["--smoke"] if device == "cpu" else case.peer_args()
    args += ["--profile-dir", str(work / f"{case.name}-peer")]
    r = run_side(args)
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-800:]}
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    out = json.loads(lines[-1]) if lines else {"error": "no JSON line in its output"}
    if "error" not in out and "tokens_per_s" not in out:  # 0.3.0 on CPU only builds the model
        return {"error": f"peer: {out.get('smoke', 'no measurement')} ({out.get('params', 0):,} params)"}
    out["profile"] = summarize(out["trace"]) if out.get("trace") else None
    return out


def kernel_diff(case: Case, m: dict, tt: dict | None) -> tuple[str, str]:
    """The row's kernel diff (meshforge - torchtitan) as a report and a one-line summary for the
    results: the check and the three largest differences."""
    if "error" in m or not tt or "error" in tt or not m.get("trace") or not tt.get("trace"):
        return "", f"kernel diff {case.name}: not run (a side has no trace)"
    try:
        text, data = compare(
            m["trace"], tt["trace"], ("meshforge", "torchtitan"), step_a=m["step_time_s"], step_b=tt["step_time_s"]
        )
    except (TraceError, OSError, ValueError, KeyError) as e:
        return "", f"kernel diff {case.name}: failed ({type(e).__name__}: {e})"[:300]
    top = ", ".join(f"{r['key'][:50]} {r['diff_us'] / 1e3:+.1f} ms" for r in data["rows"][:3])
    check = data["check"][1] if len(data["check"]) > 1 else data["check"][0]
    return f"### {case.name}\n\n{text}", f"kernel diff {case.name}: {check}; largest: {top}"


def _reason(err: str) -> str:
    """The last line of an error, shortened for a table cell ('not run: ...')."""
    last = [x for x in err.strip().splitlines() if x.strip()] or ["?"]
    return "not run: " + last[-1].replace("|", "/")[:110]


def cells(m: dict) -> str:
    """tok/s | MFU | HFU | peak GiB | profile for one side."""
    if "error" in m:
        return f"{_reason(m['error'])} | - | - | - | -"
    return (
        f"{m['tokens_per_s']:,.0f} | {100 * m['mfu']:.1f}% | {100 * m['hfu']:.1f}% | "
        f"{m.get('peak_mem_gib', 0):.1f} | {short(m.get('profile'))}"
    )


def row(case: Case, m: dict, tt: dict | None) -> str:
    """meshforge's cells, the planner's ratios, the peer's cells and the ratios between the two."""
    p = m.get("prediction")
    ok = "error" not in m
    pt = f"{p['step_time_s'] / m['step_time_s']:.2f}" if ok and isinstance(p, dict) else "-"
    pm = f"{p['mem_gib'] / m['peak_mem_gib']:.2f}" if ok and isinstance(p, dict) and m["peak_mem_gib"] else "-"
    tt = tt or {"error": "torchtitan bench not run"}
    both = ok and "error" not in tt
    ratio = f"{m['tokens_per_s'] / tt['tokens_per_s']:.2f}x" if both else "-"
    mem = f"{m['peak_mem_gib'] / tt['peak_mem_gib']:.2f}x" if both and tt.get("peak_mem_gib") else "-"
    ran = f"gb {case.global_batch} / mb {case.micro_batch}, AC {case.ac}" + (", fp8" if case.fp8 else "")
    ran += ", offload" if case.offload else ""
    return f"| {case.name} | {ran} | {cells(m)} | {pt} | {pm} | {cells(tt)} | {ratio} | {mem} |"


HEADER = (
    "| config | both sides ran | meshforge tok/s | MFU | HFU | peak GiB | profile (1 step: busy, top kernel classes %) "
    "| planner time / measured | planner mem / measured | torchtitan recipe tok/s | MFU | HFU | peak GiB | profile "
    "| tok/s mf / tt | mem mf / tt |\n" + "|---" * 17 + "|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    ap.add_argument("--only", nargs="*", help="run only these cases: " + ", ".join(c.name for c in CASES))
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on the debug preset")
    ap.add_argument("--part", type=int, help="run only the cases of this part (see run.sh)")
    ap.add_argument("--no-torchtitan", action="store_true")
    ap.add_argument("--kdiff-out", type=Path, help="write each row's kernel diff (kernel_diff.py) here")
    a = ap.parse_args(argv)
    cases = [SMOKE] if a.smoke else [c for c in CASES if (not a.only or c.name in a.only) and a.part in (None, c.part)]
    device = "cpu" if a.smoke else "cuda"
    lines, notes, reports = [HEADER], [], []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            short_mem = host_memory_short(c)
            if short_mem:
                lines.append(row(c, {"error": short_mem}, {"error": short_mem}))
                print(lines[-1], flush=True)
                continue
            m = run_meshforge(c, device, Path(tmp))
            tt = None if a.no_torchtitan else run_torchtitan(c, device, Path(tmp))
            lines.append(row(c, m, tt))
            print(lines[-1], flush=True)
            report, summary = kernel_diff(c, m, tt)
            notes.append(summary)
            reports.append(report)
            if a.kdiff_out and report:  # after every row: a part cut short keeps the rows it ran
                a.kdiff_out.parent.mkdir(parents=True, exist_ok=True)
                a.kdiff_out.write_text("\n".join(r for r in reports if r))
    print("", *notes, sep="\n", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(lines) + "\n")
    return 0  # a row that cannot run says "not run: reason"; the suite goes on


if __name__ == "__main__":
    sys.exit(main())
