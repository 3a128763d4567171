"""Planner predictions against published large runs it was not tuned on (docs/planner.md).

Each run is planned with every choice its source reports fixed (tp, pp, dp, cp, ZeRO stage,
micro-batch, recomputation, schedule), hardware from the presets, and no constant fitted to
any run. It prints the error in MFU points (HFU where the source counts recomputed FLOPs)
and the median and worst over the held-out set; the earlier validation rows (the set the
model was first tuned on) are printed after it, apart. Pure modelling: seconds, no GPU.

    python bench/bench_planner_published.py [--cross-validate]

``--cross-validate``: the constants the planner fits to published runs (docs/planner.md, "What is
fitted") are refitted on every source but one, and that source's runs predicted with them, for
every source in turn (leave one source out): the error a source the constants never saw gets.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

from meshforge.errors import ConfigError
from meshforge.planner import hardware
from meshforge.planner.model_flags import from_preset
from meshforge.planner.plan import parse_plan_args, plan_from_args

NARAYANAN = "Narayanan et al. 2021, Efficient Large-Scale LM Training on GPU Clusters Using Megatron-LM, Table 1"
KORTHIKANTI = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models, abstract"
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4"
MPT_H100 = "MosaicML llm-foundry b2a43a147, scripts/train/benchmarking/README.md, table 'H100 80GB BF16'"
MPT_A100 = "MosaicML llm-foundry b2a43a147, scripts/train/benchmarking/README.md, table 'A100 80GB'"
ISSUE28 = "meshforge issue 28, one H100 (tests/unit/test_planner_h100_table.py)"


def megatron(
    layers: int, hidden: int, heads: int, gpus: int, batch: int, tp: int, pp: int, chunks: bool = True
) -> list[str]:
    """Megatron-LM 2021 GPT (materialized attention, vocab 51200, seq 2048), full recompute,
    no ZeRO, no sequence parallelism, gradients all-reduced after backward (no overlap). N21
    section 5.1: "we use the interleaved pipeline schedule with the scatter/gather optimization
    enabled"; Megatron runs it only at pp > 2 (1F1B at pp 2) and the chunk count is not
    published: the fewest chunks (>= 2) that divide the blocks per stage. The micro-batch is
    not in the table: searched. ``chunks=False``: the schedule without a chunk count, as the
    source gives it (the planner searches the counts Megatron runs)."""
    shape = ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--mlp", "gelu"]
    shape += ["--vocab", "51200", "--seq-len", "2048", "--attention", "materialized", "--tie-embeddings"]
    shape += ["--comm-overlap", "0"]  # Megatron-LM 2021/22 all-reduced gradients after backward
    shape += ["--no-sequence-parallel"]  # sequence parallelism came with Korthikanti et al. 2022
    degrees = ["--tp", str(tp), "--pp", str(pp), "--dp", str(gpus // tp // pp), "--zero", "0", "--recompute", "full"]
    degrees += _pipeline_schedule(layers, pp) if pp > 1 and chunks else []
    degrees += ["--schedule", "interleaved_1f1b"] if pp > 2 and not chunks else []
    return shape + ["--gpu", "a100-80g", "--gpus", str(gpus), "--global-batch", str(batch)] + degrees


def _pipeline_schedule(layers: int, pp: int) -> list[str]:
    """N21's interleaved schedule where Megatron runs it (pp > 2), with the fewest chunks that
    divide the blocks per stage; 1F1B at pp 2."""
    if pp <= 2:
        return ["--schedule", "1f1b"]
    v = next(v for v in range(2, layers // pp + 1) if (layers // pp) % v == 0)
    return ["--schedule", "interleaved_1f1b", "--virtual-stages", str(v)]


def korthikanti_530b(recompute: str) -> list[str]:
    """The 530B GPT on 2,240 A100 (tp 8, pp 35, dp 8, micro-batch 1, SP on); the global batch
    is not stated with the figure: 2,240 sequences (one per GPU) is assumed. The schedule is
    not stated either: 1F1B (the 2022 Megatron-LM default)."""
    args = megatron(105, 20480, 128, 2240, 2240, 8, 35)
    at = args.index("--schedule")
    args[at : at + 4 if args[at + 1] == "interleaved_1f1b" else at + 2] = ["--schedule", "1f1b"]
    args[args.index("--recompute") + 1] = recompute
    if recompute == "selective":  # "present work": selective recomputation with sequence parallelism
        args.remove("--no-sequence-parallel")
    return args + ["--micro-batch", "1"]


def mpt(size: str, seq: int, gpus: int, micro: int, accum: int, checkpoint: bool, gpu: str) -> list[str]:
    """An MPT model as the sweep ran it (llm-foundry b2a43a147, sweep.sh and submit_benchmarks.py;
    yamls/pretrain/mpt-*.yaml): GPT-style 4h GeLU MLP, learned positions (no ALiBi), tied
    embeddings, vocab 50368, the yaml's head counts (30B: 56 heads of 128); Composer FSDP
    FULL_SHARD (ZeRO-3 over every GPU) with mixed_precision DEFAULT (parameters gathered in bf16,
    gradients reduce-scattered in fp32) after every micro-batch (Composer 0.16 enters no no_sync
    under FSDP); attn_impl triton (the 2022 Triton FlashAttention: FlashAttention-2's published rates
    on that GPU over 1.4 forward and 2 backward, as FlashAttention-2's paper measured the two)."""
    layers, hidden, heads = {
        "3b": (32, 2560, 20),
        "7b": (32, 4096, 32),
        "13b": (40, 5120, 40),
        "30b": (48, 7168, 56),
        "70b": (80, 8192, 64),
    }[size]
    shape = ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--mlp", "gelu"]
    shape += ["--vocab", "50368", "--tie-embeddings", "--seq-len", str(seq)]
    batch = gpus * micro * accum
    degrees = ["--tp", "1", "--pp", "1", "--dp", str(gpus), "--zero", "3", "--micro-batch", str(micro)]
    degrees += ["--recompute", "full" if checkpoint else "none", "--reduce-every-microbatch"]
    kernel = ["--attention-kernel", "triton-h100" if gpu.startswith("h100") else "triton-a100"]
    return shape + kernel + ["--gpu", gpu, "--gpus", str(gpus), "--global-batch", str(batch)] + degrees


def llama405b(gpus: int, tp: int, cp: int, pp: int, dp: int, seq: int) -> list[str]:
    """Llama 3 405B, 16M tokens per step, as L3 section 3.3 describes it: interleaved 1F1B
    (micro-batch 1) with one block per model chunk, the first chunk only the embedding and the
    last only the head ("we reduce one Transformer layer each from the first and the last
    stages": 126 blocks in 16 x 8 chunks), parameters gathered once per step and the optimizer
    state and gradients sharded over dp (priced as ZeRO-1: Megatron's distributed optimizer), no
    activation recomputation (the paper trains without it). The attention kernel is not
    published: FlashAttention-2, the standard of 2024 (cuDNN-first SDPA came with torch 2.9)."""
    batch = 16 * 2**20 // seq
    chunks = ",".join(["0"] + ["1"] * 126 + ["0"])
    args = ["--model", "llama3.1-405b", "--gpus", str(gpus), "--seq-len", str(seq), "--global-batch", str(batch)]
    args += ["--tp", str(tp), "--cp", str(cp), "--pp", str(pp), "--dp", str(dp), "--zero", "1", "--recompute", "none"]
    args += ["--micro-batch", "1", "--schedule", "interleaved_1f1b", "--virtual-stages", "8", "--pp-layers", chunks]
    return args + ["--attention-kernel", "fa2-h100"]


HELD_OUT = [  # (name, source, published figure, metric, arguments)
    ("GPT 1.7B, 32 A100, tp1", NARAYANAN, 137 / 312, "hfu", megatron(24, 2304, 24, 32, 512, 1, 1)),
    ("GPT 3.6B, 64 A100, tp2", NARAYANAN, 138 / 312, "hfu", megatron(30, 3072, 32, 64, 512, 2, 1)),
    ("GPT 7.5B, 128 A100, tp4", NARAYANAN, 142 / 312, "hfu", megatron(36, 4096, 32, 128, 512, 4, 1)),
    ("GPT 39.1B, 512 A100, pp2", NARAYANAN, 138 / 312, "hfu", megatron(48, 8192, 64, 512, 1536, 8, 2)),
    ("GPT 76.1B, 1024 A100, pp4", NARAYANAN, 140 / 312, "hfu", megatron(60, 10240, 80, 1024, 1792, 8, 4)),
    ("GPT 310.1B, 1920 A100, pp16", NARAYANAN, 155 / 312, "hfu", megatron(96, 16384, 128, 1920, 2160, 8, 16)),
    ("GPT 530B, 2240 A100, full", KORTHIKANTI, 0.421, "mfu", korthikanti_530b("full")),
    ("GPT 530B, 2240 A100, selective", KORTHIKANTI, 0.542, "mfu", korthikanti_530b("selective")),
    ("Llama3 405B, 16K H100, cp16", LLAMA3, 0.38, "mfu", llama405b(16384, 8, 16, 16, 8, 131072)),
    ("MPT 70B, 64 H100, s2k ckpt", MPT_H100, 0.4257, "mfu", mpt("70b", 2048, 64, 8, 4, True, "h100-sxm")),
    ("MPT 30B, 32 H100, s2k ckpt", MPT_H100, 0.4392, "mfu", mpt("30b", 2048, 32, 14, 3, True, "h100-sxm")),
    ("MPT 30B, 8 H100, s8k ckpt", MPT_H100, 0.2992, "mfu", mpt("30b", 8192, 8, 1, 21, True, "h100-sxm")),
    ("MPT 13B, 8 H100, s4k ckpt", MPT_H100, 0.416, "mfu", mpt("13b", 4096, 8, 10, 3, True, "h100-sxm")),
    ("MPT 13B, 8 H100, s2k", MPT_H100, 0.3979, "mfu", mpt("13b", 2048, 8, 2, 1, False, "h100-sxm")),
    ("MPT 7B, 8 H100, s8k ckpt", MPT_H100, 0.3714, "mfu", mpt("7b", 8192, 8, 8, 2, True, "h100-sxm")),
    ("MPT 7B, 8 H100, s2k", MPT_H100, 0.4644, "mfu", mpt("7b", 2048, 8, 6, 1, False, "h100-sxm")),
    ("MPT 3B, 16 H100, s2k", MPT_H100, 0.4373, "mfu", mpt("3b", 2048, 16, 10, 3, False, "h100-sxm")),
    ("MPT 30B, 8 A100, s2k ckpt", MPT_A100, 0.553, "mfu", mpt("30b", 2048, 8, 3, 21, True, "a100-80g")),
    ("MPT 13B, 8 A100, s4k ckpt", MPT_A100, 0.5762, "mfu", mpt("13b", 4096, 8, 10, 3, True, "a100-80g")),
    ("MPT 13B, 8 A100, s2k", MPT_A100, 0.5957, "mfu", mpt("13b", 2048, 8, 2, 3, False, "a100-80g")),
    ("MPT 7B, 8 A100, s8k ckpt", MPT_A100, 0.5447, "mfu", mpt("7b", 8192, 8, 8, 2, True, "a100-80g")),
    ("MPT 7B, 8 A100, s2k", MPT_A100, 0.6423, "mfu", mpt("7b", 2048, 8, 6, 2, False, "a100-80g")),
    ("MPT 3B, 8 A100, s2k", MPT_A100, 0.6211, "mfu", mpt("3b", 2048, 8, 10, 2, False, "a100-80g")),
    ("MPT 3B, 8 A100, s8k", MPT_A100, 0.5934, "mfu", mpt("3b", 8192, 8, 3, 6, False, "a100-80g")),
]

EARLIER = [  # the first validation set (the model's constants were chosen looking at these)
    ("Llama3 405B, 8K H100", LLAMA3, 0.43, "mfu", llama405b(8192, 8, 1, 16, 64, 8192)),
    ("Llama3 405B, 16K H100", LLAMA3, 0.41, "mfu", llama405b(16384, 8, 1, 16, 128, 8192)),
    ("GPT 18.4B, 256 A100", NARAYANAN, 135 / 312, "hfu", megatron(40, 6144, 48, 256, 1024, 8, 1)),
    ("GPT 145.6B, 1536 A100", NARAYANAN, 148 / 312, "hfu", megatron(80, 12288, 96, 1536, 2304, 8, 8)),
    ("GPT 529.6B, 2520 A100", NARAYANAN, 163 / 312, "hfu", megatron(105, 20480, 128, 2520, 2520, 8, 35)),
    ("GPT 1008B, 3072 A100", NARAYANAN, 163 / 312, "hfu", megatron(128, 25600, 160, 3072, 3072, 8, 64)),
]


UNSTATED_CHUNKS = [  # N21 Table 1 layouts run interleaved with no chunk count given (refused before issue 38)
    ("GPT 76.1B, 1024 A100, pp4", NARAYANAN, 140 / 312, "hfu", megatron(60, 10240, 80, 1024, 1792, 8, 4, False)),
    ("GPT 529.6B, 2520 A100, pp35", NARAYANAN, 163 / 312, "hfu", megatron(105, 20480, 128, 2520, 2520, 8, 35, False)),
]


BESIDE = [  # further rows of the same MPT tables, not in the set: printed beside it (issue 51), in no summary
    ("MPT 30B, 8 H100, s4k ckpt", MPT_H100, 0.3586, "mfu", mpt("30b", 4096, 8, 1, 21, True, "h100-sxm")),
    ("MPT 30B, 8 H100, s2k ckpt", MPT_H100, 0.3811, "mfu", mpt("30b", 2048, 8, 3, 21, True, "h100-sxm")),
    ("MPT 30B, 8 H100, s1k ckpt", MPT_H100, 0.3876, "mfu", mpt("30b", 1024, 8, 6, 21, True, "h100-sxm")),
    ("MPT 13B, 8 H100, s32k ckpt", MPT_H100, 0.3168, "mfu", mpt("13b", 32768, 8, 1, 3, True, "h100-sxm")),
    ("MPT 7B, 8 H100, s64k ckpt", MPT_H100, 0.2859, "mfu", mpt("7b", 65536, 8, 1, 2, True, "h100-sxm")),
    ("MPT 30B, 8 A100, s8k ckpt", MPT_A100, 0.3938, "mfu", mpt("30b", 8192, 8, 1, 21, True, "a100-80g")),
    ("MPT 30B, 8 A100, s4k ckpt", MPT_A100, 0.5137, "mfu", mpt("30b", 4096, 8, 1, 21, True, "a100-80g")),
    ("MPT 30B, 8 A100, s1k ckpt", MPT_A100, 0.5582, "mfu", mpt("30b", 1024, 8, 6, 21, True, "a100-80g")),
    ("MPT 13B, 8 A100, s32k ckpt", MPT_A100, 0.5169, "mfu", mpt("13b", 32768, 8, 1, 3, True, "a100-80g")),
    ("MPT 7B, 8 A100, s64k ckpt", MPT_A100, 0.4697, "mfu", mpt("7b", 65536, 8, 1, 2, True, "a100-80g")),
]


def predict(argv: list[str], metric: str) -> tuple[float, str, bool]:
    """The planner's MFU for one run, its layout in words, whether it fits, and the factor that
    turns the source's figure into MFU (N21 reports HFU in Megatron's convention: compared as MFU,
    so that no recomputation convention enters the comparison)."""
    pl = plan_from_args(parse_plan_args([*argv, "--gpus-per-node", "8"]))
    e = pl.results[0]
    L = e.layout
    lay = f"tp{L.tp} pp{L.pp} dp{L.dp} cp{L.cp} z{L.zero_stage} mb{L.micro_batch_size} {L.activation_checkpoint}"
    if L.pp > 1:
        lay += " " + {"interleaved_1f1b": f"i1f1b v{L.pp_virtual_stages}"}.get(L.pp_schedule, L.pp_schedule)
    return e.mfu, lay, e.fits, _to_mfu(pl) if metric == "hfu" else 1.0


def _to_mfu(pl) -> float:
    """N21's HFU as MFU: its model FLOPs over its hardware FLOPs (the same tokens per second)."""
    return pl.shape.model_flops_per_token(pl.seq) / megatron_flops_per_token(pl)


def megatron_flops_per_token(pl) -> float:
    """N21's hardware FLOPs (its equation 3 per token): 96·l·h²·(1 + s/6h + V/16lh), i.e. the blocks'
    forward four times (Megatron's checkpointing reruns every block whole, w2 included) and the
    head three times. meshforge's HFU counts what its own recomputation runs (no w2, no head)."""
    a, s = pl.shape, pl.seq
    return 96 * a.layers * a.hidden**2 + 16 * a.layers * s * a.hidden + 6 * a.vocab_size * a.hidden


def table(runs: list, title: str) -> list[float]:
    print(f"\n{title}")
    print(f"{'run':<32} {'layout':<48} {'published':>9} {'predicted':>9} {'error':>7}")
    errors = []
    for name, _source, published, metric, argv in runs:
        try:
            pred, lay, fits, scale = predict(argv, metric)
        except ConfigError as e:
            sys.exit(f"{name}: {e}")
        published *= scale
        err = 100 * (pred - published)
        errors.append(abs(err))
        note = "" if fits else "  (predicted not to fit)"
        was = f" (HFU {100 * published / scale:.1f}%)" if metric == "hfu" else ""
        print(f"{name:<32} {lay:<48} {100 * published:>8.1f}% {100 * pred:>8.1f}% {err:>+6.1f}  MFU{was}{note}")
    print(f"|error| in points: median {statistics.median(errors):.1f}, worst {max(errors):.1f} ({len(errors)} runs)")
    return errors


def issue28(model: str, seq: int, batch: int, mb: int, rc: str, compiled: bool, tps: float) -> tuple:
    """An issue-28 H100 row as (published MFU, arguments): the measured tokens/s as MFU."""
    argv = ["--model", model, "--gpus", "1", "--gpu", "h100-sxm", "--seq-len", str(seq), "--global-batch", str(batch)]
    argv += ["--micro-batch", str(mb), "--tp", "1", "--pp", "1", "--dp", "1", "--zero", "0", "--recompute", rc]
    argv += ["--compiled" if compiled else "--eager"]
    mfu = from_preset(model).model_flops_per_token(seq) * tps / hardware.PRESETS["h100-sxm"].peak("bf16")
    return mfu, argv


ISSUE28_ROWS = [  # (run, *issue28 arguments): meshforge's own H100 measurements (issue 28)
    ("1B 4K eager", "llama3.2-1b", 4096, 16, 2, "none", False, 43374),
    ("1B 8K eager", "llama3.2-1b", 8192, 8, 1, "none", False, 39275),
    ("1B 4K compiled", "llama3.2-1b", 4096, 16, 2, "none", True, 55010),
    ("1B 8K compiled", "llama3.2-1b", 8192, 8, 1, "none", True, 48718),
    ("3B 4K compiled full AC", "llama3.2-3b", 4096, 16, 2, "full", True, 19396),
    ("1B 16K batch 1 compiled", "llama3.2-1b", 16384, 1, 1, "none", True, 40662),
]
OWN = [(f"meshforge {r[0]}", ISSUE28, *(lambda m, a: (m, "mfu", a))(*issue28(*r[1:]))) for r in ISSUE28_ROWS]

SHORT = {NARAYANAN: "N21", KORTHIKANTI: "K22", LLAMA3: "L3", MPT_H100: "MPT H100", MPT_A100: "MPT A100"}
SHORT[ISSUE28] = "meshforge H100 (issue 28)"

# What the planner fits to published runs, per GPU generation (docs/planner.md, "What is fitted"):
# the share of peak a large GEMM reaches. name -> (presets it sets, its current value)
FITTED = {
    "AMPERE_GEMM": (("a100-40g", "a100-80g"), hardware.AMPERE_GEMM),
    "HOPPER_GEMM_BEST": (("h100-sxm", "h100-pcie", "h200"), hardware.HOPPER_GEMM_BEST),
}


def set_constant(name: str, value: float) -> None:
    for preset in FITTED[name][0]:
        hardware.PRESETS[preset] = replace(hardware.PRESETS[preset], gemm_efficiency=value)


def uses(run: tuple, name: str) -> bool:
    argv = run[4]
    gpu = argv[argv.index("--gpu") + 1] if "--gpu" in argv else "h100-sxm"  # (the planner's default)
    return gpu in FITTED[name][0]


def errors_of(runs: list, cache: dict, key: tuple) -> list[float]:
    out = []
    for run in runs:
        if (run[0], key) not in cache:
            pred, _, _, scale = predict(run[4], run[3])
            cache[(run[0], key)] = 100 * (pred - run[2] * scale)
        out.append(cache[(run[0], key)])
    return out


def fit(name: str, runs: list, cache: dict) -> float:
    """The value of ``name`` that minimises the median |error| over ``runs`` (a grid, then finer)."""
    best, grid = FITTED[name][1], [0.40 + 0.02 * i for i in range(26)]
    for step in (0.02, 0.005):
        scored = []
        for v in grid:
            set_constant(name, v)
            scored.append((statistics.median(abs(e) for e in errors_of(runs, cache, (name, round(v, 4)))), v))
        best = min(scored)[1]
        grid = [best + step / 4 * i for i in range(-4, 5)] if step == 0.02 else grid
    set_constant(name, FITTED[name][1])
    return best


def cross_validate() -> dict[str, list[tuple[str, float]]]:
    """Leave one source out: refit FITTED on the others, predict it; each source's (run, error) pairs."""
    runs = HELD_OUT + EARLIER + OWN
    sources = list(dict.fromkeys(r[1] for r in runs))
    cache: dict = {}
    every, held = [], {}
    print("leave one source out (the GEMM shares refitted on the other sources)")
    for src in sources:
        mine, rest = [r for r in runs if r[1] == src], [r for r in runs if r[1] != src]
        fitted = {}
        for name in FITTED:
            train = [r for r in rest if uses(r, name)]
            if any(uses(r, name) for r in mine):
                fitted[name] = fit(name, train, cache) if train else FITTED[name][1]
        for name, v in fitted.items():
            set_constant(name, v)
        errs = errors_of(mine, cache, tuple(sorted((k, round(v, 4)) for k, v in fitted.items())))
        for name in fitted:
            set_constant(name, FITTED[name][1])
        every += [abs(e) for e in errs]
        held[SHORT[src]] = [(r[0], e) for r, e in zip(mine, errs, strict=True)]
        consts = ", ".join(f"{k} {v:.3f}" for k, v in fitted.items())
        worst = f"median {statistics.median(abs(e) for e in errs):.1f}, worst {max(map(abs, errs)):.1f}"
        print(
            f"  {SHORT[src]:<26} {len(mine):>2} runs, {consts}: |error| {worst}; " + " ".join(f"{e:+.1f}" for e in errs)
        )
    print(f"every source held out in turn: |error| median {statistics.median(every):.1f}, worst {max(every):.1f} "
          f"({len(every)} runs; target: median <= 3, worst <= 8)")  # fmt: skip
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cross-validate", action="store_true", help="leave one source out, refitting the constants")
    if ap.parse_args().cross_validate:
        cross_validate()
        return
    errors = table(HELD_OUT, "held-out published runs (target: median <= 3, worst <= 8 points)")
    errors += table(EARLIER, "earlier validation set (not held out)")
    errors += table(UNSTATED_CHUNKS, "interleaved without a chunk count (the planner picks it)")
    errors += table(OWN, "meshforge's own H100 runs (issue 28: measured tokens/s as MFU)")
    print(f"\nevery run: median {statistics.median(errors):.1f}, worst {max(errors):.1f} ({len(errors)} runs)")
    table(BESIDE, "beside the set: further rows of the MPT tables (in no summary above)")


if __name__ == "__main__":
    main()
