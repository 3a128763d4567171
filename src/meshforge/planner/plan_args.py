"""``meshforge plan``'s command line: the flags for the model, the training run, the cluster
and the fixed layout choices, each parsed into a value in its range (a typo is refused with
the flag's name and range before any search runs)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from meshforge.parallel.rules import OFFLOAD
from meshforge.planner import diloco_costs
from meshforge.planner.estimate import SCHEDULES, V_SCHEDULES
from meshforge.planner.hardware import ATTENTION_KERNELS, PRESETS


def whole(lo: int = 1, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number in lo..hi, refused with the range (argparse names the flag)."""

    def check(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {raw!r}") from None
        if v < lo or (hi is not None and v > hi):
            if lo == 1:
                want = "a positive integer" + (f" up to {hi:,}" if hi is not None else "")
            else:
                want = f"an integer in {lo}..{hi:,}" if hi is not None else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {v}")
        return v

    return check


def real(lo: float = 0.0, hi: float | None = None, lo_open: bool = True) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number above lo (or from lo, lo_open=False) and up to hi."""

    def check(raw: str) -> float:
        try:
            v = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {raw!r}") from None
        low_bad = v <= lo if lo_open else v < lo
        if not math.isfinite(v) or low_bad or (hi is not None and v > hi):
            want = f"in {lo:g}..{hi:g}" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}"
            raise argparse.ArgumentTypeError(f"must be a number {want}, got {raw}")
        return v

    return check


# upper bounds of the planner's counts: far above any published run, low enough that a typo
# (an extra digit or ten) is refused by name instead of searching for minutes
MAX_GPUS = 2**20


MAX_LAYERS = 4096


MAX_WIDTH = 2**22  # hidden, ffn and expert sizes, heads


MAX_TOKENS = 2**24  # vocabulary, positions, sequence length, batch sizes


MAX_EXPERTS = 2**16


def sizes(raw: str) -> tuple[int, ...]:
    """An argparse ``type=``: comma-separated whole numbers (blocks per pipeline chunk)."""
    try:
        out = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers, e.g. 0,8,8,0; got {raw!r}") from None
    if any(x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 0, got {raw!r}")
    if len(out) > MAX_LAYERS or sum(out) > MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_LAYERS:,} blocks in all, got {raw!r}")
    return out


SHAPE_FLAGS = {  # flag -> help
    "layers": "transformer blocks (explicit shape)",
    "hidden": "hidden size (explicit shape)",
    "heads": "attention heads (explicit shape)",
    "kv-heads": "key/value heads, grouped-query attention (default: --heads)",
    "ffn-hidden": "feed-forward hidden size (default for --mlp gelu: 4 x --hidden)",
    "vocab": "vocabulary size (explicit shape)",
    "max-positions": "position table size for learned positions (default: none, rotary)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a preset, explicit shape, or --config)")
    m.add_argument("--model", help="preset name, e.g. llama3.1-405b")
    m.add_argument("--config", help="a meshforge train config (e.g. a run's config.toml): model, batch, degrees")
    for k, h in SHAPE_FLAGS.items():
        hi = MAX_LAYERS if k == "layers" else MAX_TOKENS if k in ("vocab", "max-positions") else MAX_WIDTH
        m.add_argument(f"--{k}", type=whole(1, hi), metavar="N", help=h)
    m.add_argument("--mlp", choices=["swiglu", "gelu"], default="swiglu", help="MLP kind (default swiglu)")
    m.add_argument("--tie-embeddings", action="store_true", help="the output head shares the embedding's weight")
    m.add_argument(
        "--attention",
        choices=["flash", "materialized"],
        default="flash",
        help="attention kernel: fused (flash, meshforge's) or scores written out (Megatron-LM 2021/22)",
    )
    m.add_argument(
        "--attention-kernel",
        choices=sorted(ATTENTION_KERNELS),
        help="the fused attention kernel's published rates (planner/hardware.py; default: the preset's, "
        "on Hopper cuDNN as torch picks it; fa2-h100 for runs on flash-attn 2)",
    )
    add_moe_arguments(m)
    _add_training_arguments(p)
    _add_cluster_arguments(p)
    _add_fixed_arguments(p)
    diloco_costs.add_arguments(p, whole, real)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=whole(), default=10, metavar="N", help="rows of the ranking to show (default 10)")
    o.add_argument("--json", action="store_true", help="print the ranking as JSON instead of a table")
    o.add_argument("--emit-config", metavar="FILE", help="write a meshforge train config for the best runnable layout")


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training")
    t.add_argument(
        "--seq-len",
        type=whole(1, MAX_TOKENS),
        metavar="N",
        help="tokens per sequence (default: the --config's, else 4096)",
    )
    t.add_argument(
        "--global-batch",
        type=whole(1, MAX_TOKENS),
        metavar="N",
        help="sequences per optimizer step (default: the --config's, else one per GPU, i.e. --gpus)",
    )
    t.add_argument(
        "--precision", choices=["bf16", "fp32", "fp8"], help="training precision (default: bf16; fp32 on cpu)"
    )
    t.add_argument(
        "--mean-doc-len",
        type=real(0.0, MAX_TOKENS),
        metavar="N",
        help="packed documents of this mean length (tokens), attention masked at their boundaries "
        "(data.document_mask): attention priced as it runs (default: none, causal over the sequence)",
    )


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--gpu",
        metavar="PRESET",
        help=f"hardware preset, one of: {', '.join(PRESETS)} (default: h100-sxm; with --config, the run's "
        "device: cpu for a CPU run, this machine's GPU for a CUDA one)",
    )
    c.add_argument("--hardware", help="a profile written by meshforge calibrate (overrides --gpu)")
    c.add_argument("--gpus", type=whole(1, MAX_GPUS), metavar="N", help="GPUs in the cluster (required)")
    c.add_argument("--gpus-per-node", type=whole(1, 1024), default=8, metavar="N", help="GPUs per node (default 8)")
    c.add_argument(
        "--inter-node-bw", type=real(), metavar="GBS", help="network bandwidth per GPU in GB/s (default: the preset's)"
    )
    c.add_argument(
        "--comm-overlap",
        type=real(0.0, 1.0, lo_open=False),
        metavar="F",
        help="share (0..1) of data-parallel traffic that hides under compute (default: the hardware's; 0 for a "
        "framework that reduces gradients only after backward, e.g. Megatron-LM before 2023)",
    )
    c.add_argument(
        "--reduce-every-microbatch",
        action="store_true",
        help="ZeRO-2/3 gradients are reduce-scattered after every micro-batch, not once per step (a framework "
        "that does not skip the reduction under accumulation, e.g. Composer's FSDP)",
    )
    c = p.add_mutually_exclusive_group()  # (the compile flags: see estimate's eager terms)
    c.add_argument(
        "--eager",
        dest="eager",
        action="store_const",
        const=True,
        help="the run is not compiled (train.compile = false): element-wise chains and the loss run op by op",
    )
    c.add_argument("--compiled", dest="eager", action="store_const", const=False, help="the run is compiled (default)")
    p.add_argument(
        "--mixed-precision",
        choices=("auto", "cast_once", "autocast"),
        help="how bf16 runs (train.mixed_precision; --config takes the file's): cast_once, FSDP2 casting the "
        "gathered weights once (bf16 activations), or autocast over fp32 weights (an fp32 residual stream and "
        "bf16 weight copies); auto (default): cast_once on a GPU, autocast on a CPU",
    )


FIXED_HELP = {
    "tp": "tensor-parallel degree",
    "pp": "pipeline-parallel degree",
    "dp": "data-parallel degree",
    "cp": "context-parallel degree",
    "micro-batch": "sequences per forward pass",
    "virtual-stages": "model chunks per pipeline rank (interleaved schedules)",
}


def _add_fixed_arguments(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fixed choices (the rest is searched)")
    for k, h in FIXED_HELP.items():
        hi = MAX_TOKENS if k == "micro-batch" else MAX_LAYERS if k == "virtual-stages" else MAX_GPUS
        f.add_argument(f"--{k}", type=whole(1, hi), metavar="N", help=f"{h} (searched when left out)")
    f.add_argument(
        "--pp-layers",
        type=sizes,
        metavar="N,N,...",
        help="blocks per pipeline chunk in pipeline order, pp x virtual stages of them (parallel.pp_layers); the "
        "first and last may be 0 (embedding-only, head-only chunk); default: balanced",
    )
    f.add_argument(
        "--zero", type=whole(0, 3), metavar="STAGE", help="ZeRO stage 0..3 (0: DDP, 3: FSDP; searched when left out)"
    )
    f.add_argument(
        "--ep",
        type=whole(1, MAX_EXPERTS),
        metavar="N",
        help="expert-parallel degree (MoE): experts split over ep of the dp x cp ranks, FSDP over the rest; "
        "searched over the divisors of --experts when left out",
    )
    f.add_argument(
        "--recompute", choices=["none", "selective", "full"], help="activation recomputation (searched when left out)"
    )
    f.add_argument(
        "--schedule", choices=SCHEDULES + V_SCHEDULES, help="pipeline schedule with --pp > 1 (searched when left out)"
    )
    f.add_argument(
        "--offload",
        choices=list(OFFLOAD),
        help="CPU offload of the sharded model states (FSDP2, ZeRO-2/3; parallel.offload): auto (default) searches "
        "it only when nothing fits without it, none never, cpu always",
    )
    f.add_argument(
        "--tp-overlap",
        action="store_true",
        help="overlap tp collectives with the GEMMs beside them (async TP, Megatron-Core --tp-comm-overlap; "
        "parallel.async_tp): hidden as far as each chunked GEMM lasts",
    )
    f.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="tp without sequence parallelism: norms, dropout and residual adds replicated on every tp rank",
    )


# layout key -> the flag that fixes it (the rest of the layout is searched)
FIXED_FLAGS = {
    "tp": "tp",
    "pp": "pp",
    "dp_shard": "dp",
    "cp": "cp",
    "ep": "ep",
    "zero_stage": "zero",
    "micro_batch_size": "micro_batch",
    "activation_checkpoint": "recompute",
    "pp_virtual_stages": "virtual_stages",
    "pp_schedule": "schedule",
    "offload": "offload",
}


MOE_FLAGS = {  # flag -> ModelShape field
    "experts": "num_experts",
    "top_k": "experts_per_token",
    "moe_ffn_hidden": "moe_ffn_hidden",
    "shared_experts": "num_shared_experts",
    "capacity_factor": "capacity_factor",
}


def add_moe_arguments(m: argparse._ArgumentGroup) -> None:
    """The mixture-of-experts shape (docs/moe.md); with --model or --config they replace the preset's."""
    m.add_argument(
        "--experts", type=whole(0, MAX_EXPERTS), help="routed experts per MoE block (mixture of experts; 0: dense)"
    )
    m.add_argument("--top-k", type=whole(1, MAX_EXPERTS), help="experts each token is sent to (default 2)")
    m.add_argument(
        "--moe-ffn-hidden", type=whole(1, MAX_WIDTH), help="hidden size of one expert (default: --ffn-hidden)"
    )
    m.add_argument(
        "--shared-experts", type=whole(0, MAX_EXPERTS), help="always-on experts of --moe-ffn-hidden each (default 0)"
    )
    m.add_argument(
        "--capacity-factor",
        type=real(0.0, lo_open=False),
        help="expert capacity (model.capacity_factor): 0 dropless (default), > 0 caps each expert at cf x its mean "
        "load, which caps the planner's load imbalance",
    )
