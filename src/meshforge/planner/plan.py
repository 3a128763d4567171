"""``meshforge plan``: read the model, training and cluster from the command line (or a
train config), search, and print or write the answer."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.layout import open_layout
from meshforge.models.shape import ModelShape
from meshforge.parallel.dims import OFFLOAD
from meshforge.planner import diloco_costs, output
from meshforge.planner.estimate import SCHEDULES, V_SCHEDULES
from meshforge.planner.hardware import ATTENTION_KERNELS, PRESETS, Hardware, get_hardware, preset_for_device
from meshforge.planner.model_flags import check_flags, from_preset, named
from meshforge.planner.search import Ranked, search


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


def _with_moe_flags(shape: ModelShape, args: argparse.Namespace) -> tuple[ModelShape, bool]:
    """The shape with the MoE flags given laid over it (re-checked), and whether any was given."""
    given = {field: getattr(args, flag) for flag, field in MOE_FLAGS.items() if getattr(args, flag, None) is not None}
    if not given:
        return shape, False
    return check_flags(ModelShape(**{**shape.__dict__, **given})), True


def _model_of(args: argparse.Namespace) -> tuple[ModelShape, dict, str | None]:
    """The model, training defaults taken from --config, and the preset name (if any)."""
    given = [f"--{k}" for k in SHAPE_FLAGS if getattr(args, k.replace("-", "_")) is not None]
    given += ["--tie-embeddings"] if args.tie_embeddings else []
    if (args.config or args.model) and given:
        raise ConfigError(
            f"{', '.join(given)} describe(s) an explicit shape, which --{'config' if args.config else 'model'} "
            "replaces (the flags would be ignored); drop one of them"
        )
    if args.config:
        return _from_config(args.config)
    if args.model:
        return from_preset(args.model), {}, args.model
    return _from_flags(args), {}, None


def _from_config(path: str) -> tuple[ModelShape, dict, str | None]:
    """A run config's model, and as fixed choices what the file itself sets (a run's resolved
    config.toml sets everything)."""
    cfg = load_config(path, {})
    shape = named(cfg.shape, Path(path).stem)
    raw = _raw_toml(path)
    par, tr = raw.get("parallel", {}), raw.get("train", {})
    given = raw.get("model", {})
    preset = cfg.model.preset if not any(k in given for k in ("hidden", "layers")) else None
    p, t = cfg.layout, cfg.train
    from_cfg = {"seq_len": t.seq_len, "global_batch": t.global_batch_size, "compile": t.compile}
    from_cfg["device"] = t.device
    from_cfg["loss_chunk"] = t.loss_chunk_size  # the memory model's loss part (planner/memory.py)
    from_cfg["mixed_precision"] = t.mixed_precision  # bf16 by autocast or cast once (auto: by the device)
    if "precision" in tr and t.precision != "auto":
        from_cfg["precision"] = t.precision
    from_cfg |= {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if k in par and getattr(p, k) > 0}
    from_cfg |= {k: getattr(p, k) for k in ("zero_stage", "offload", "async_tp") if k in par}
    if "dp_shard" in par and "dp_replicate" in par and p.dp_shard > 0 and p.dp_replicate > 0:
        from_cfg["dp_shard"] = p.dp_shard * p.dp_replicate
    if "pp_schedule" in par and p.pp > 1:
        from_cfg["pp_schedule"] = {"interleaved": "interleaved_1f1b"}.get(p.pp_schedule, p.pp_schedule)
    if "pp_layers" in par and p.pp > 1 and p.pp_layers:
        from_cfg["pp_layers"] = tuple(p.pp_layers)
    if "pp_virtual_stages" in par and p.pp > 1 and p.pp_virtual_stages > 1:
        from_cfg["pp_virtual_stages"] = p.pp_virtual_stages
    dp = from_cfg.get("dp_shard")
    if p.pp > 1 and dp and p.num_microbatches:  # the schedule's micro-batches
        from_cfg["micro_batch_size"] = max(1, t.global_batch_size // dp // p.num_microbatches)
    elif tr.get("micro_batch_size"):
        from_cfg["micro_batch_size"] = p.micro_batch_size
    elif "micro_batch_size" in tr and dp:  # 0: the whole local batch in one pass
        from_cfg["micro_batch_size"] = max(1, t.global_batch_size // dp)
    if "activation_checkpoint" in tr:
        from_cfg["activation_checkpoint"] = p.activation_checkpoint
    return shape, from_cfg, preset


def _from_flags(args: argparse.Namespace) -> ModelShape:
    """The model given as --layers, --hidden, ... (a GPT MLP is 4 x hidden unless given)."""
    if args.ffn_hidden is None and args.mlp == "gelu" and args.hidden:
        args.ffn_hidden = 4 * args.hidden
    need = ("layers", "hidden", "heads", "ffn_hidden", "vocab")
    missing = [k for k in need if getattr(args, k) is None]
    if missing:
        raise ConfigError(
            "give the model as --model PRESET, --config FILE, or an explicit shape (missing: "
            + ", ".join("--" + k.replace("_", "-") for k in missing)
            + ")"
        )
    shape = ModelShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        ffn_hidden=args.ffn_hidden,
        vocab_size=args.vocab,
        mlp=args.mlp,
        tie_embeddings=args.tie_embeddings,
        max_positions=args.max_positions or 0,
        attention=args.attention,
        name="custom",
    )
    return check_flags(shape)


def _raw_toml(path: str) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


@dataclass
class Planned:
    """One search's inputs and answer, as ``meshforge plan`` and the run report use them."""

    results: Ranked
    considered: int
    shape: ModelShape
    hw: Hardware
    global_batch: int
    seq: int
    precision: str
    preset: str | None


def plan_from_args(args: argparse.Namespace) -> Planned:
    """Search the layouts the parsed ``meshforge plan`` arguments allow (no printing)."""
    shape, dflt, preset = _model_of(args)
    shape, overridden = _with_moe_flags(shape, args)
    preset = None if overridden else preset  # --emit-config then writes the shape itself
    if args.gpus is not None:
        dflt = _for_gpus(dflt, args.gpus)
    hw = get_hardware(args.gpu or _device_preset(dflt.get("device", "")), args.hardware)
    if args.inter_node_bw is not None:
        hw.inter_bw = args.inter_node_bw * 1e9
    hw.eager = bool(args.eager) if args.eager is not None else not dflt.get("compile", True)
    hw.loss_chunk = dflt.get("loss_chunk", hw.loss_chunk)
    hw.mixed_precision = args.mixed_precision or dflt.get("mixed_precision", hw.mixed_precision)
    if args.comm_overlap is not None:
        hw.comm_overlap = args.comm_overlap
    hw.reduce_every_microbatch = bool(args.reduce_every_microbatch)
    hw.mean_doc_len = args.mean_doc_len or 0.0  # (planner/document_costs.py)
    if args.attention_kernel:
        hw.attention_kernel = ATTENTION_KERNELS[args.attention_kernel]
    if args.gpus is None:
        raise ConfigError("--gpus N (the cluster size, a positive integer) is required")
    seq = args.seq_len if args.seq_len is not None else dflt.get("seq_len") or 4096
    gb = args.global_batch if args.global_batch is not None else dflt.get("global_batch") or args.gpus
    precision = args.precision or dflt.get("precision") or ("fp32" if hw.name == "cpu" else "bf16")

    def pick(name: str, cli_name: str | None = None):
        v = getattr(args, cli_name or name)
        return v if v is not None else dflt.get(name)

    fixed = open_layout(
        **{key: pick(key, flag) for key, flag in FIXED_FLAGS.items()},
        sequence_parallel=not args.no_sequence_parallel,
        async_tp=bool(args.tp_overlap or dflt.get("async_tp")),
        pp_layers=tuple(args.pp_layers or dflt.get("pp_layers") or ()),
    )
    results, considered = search(shape, hw, args.gpus, args.gpus_per_node, gb, seq, precision, fixed)
    return Planned(results, considered, shape, hw, gb, seq, precision, preset)


LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "dp_shard", "micro_batch_size", "pp_schedule", "pp_virtual_stages", "pp_layers")


def _for_gpus(dflt: dict, gpus: int) -> dict:
    """--config's fixed choices for ``gpus`` GPUs: a layout made for another number of ranks
    (a run's config.toml on 1 rank, re-planned on 8) is searched afresh, the model, batch,
    precision and ZeRO stage kept, and the note says so."""
    degrees = [dflt.get(k, 1) for k in ("tp", "pp", "cp", "dp_shard")]
    if "dp_shard" not in dflt or math.prod(degrees) == gpus:
        return dflt
    print(
        f"meshforge plan: --config's layout is for {math.prod(degrees)} rank(s); searching the layouts for "
        f"--gpus {gpus} (its model, batch, precision and ZeRO stage kept)",
        file=sys.stderr,
    )
    return {k: v for k, v in dflt.items() if k not in LAYOUT_KEYS}


def _device_preset(device: str) -> str:
    """The hardware preset for --config's device when --gpu is not given: the CPU for a CPU
    run, this machine's GPU for a CUDA run where one is visible, else an H100."""
    if device == "cpu":
        return "cpu"
    if device in ("cuda", "auto"):
        import torch  # (only when a CUDA run is planned without --gpu)

        if torch.cuda.is_available():
            return preset_for_device(torch.cuda.get_device_name(0))
    return "h100-sxm"


def parse_plan_args(argv: list[str]) -> argparse.Namespace:
    """``meshforge plan`` arguments from a list (for callers that plan in-process)."""
    p = argparse.ArgumentParser(prog="meshforge plan")
    add_arguments(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if unused := diloco_costs.unused_flags(args):
        raise ConfigError(f"{', '.join(unused)} compare(s) DDP and DiLoCo across islands: add --islands M (M > 1)")
    pl = plan_from_args(args)
    results, considered, shape, hw = pl.results, pl.considered, pl.shape, pl.hw
    gb, seq, precision, preset = pl.global_batch, pl.seq, pl.precision, pl.preset
    elapsed = time.perf_counter() - t0
    islands = diloco_costs.island_costs(shape.num_params(), results[0].step_time_s, args) if args.islands > 1 else None
    if args.json:
        text = output.as_json(results, args.top, shape, considered, results.refused)
        print(text if islands is None else json.dumps({**json.loads(text), "islands": asdict(islands)}, indent=1))
    else:
        active = shape.active_params()
        moe = "" if active == shape.num_params() else f" ({output.count(active)} active, {shape.num_experts} experts)"
        print(
            f"{shape.name}: {output.count(shape.num_params())} parameters{moe} | {args.gpus} x {hw.name} "
            f"({args.gpus_per_node} per node, {hw.source}) | global batch {gb} x {seq} tokens, {precision} | "
            f"{f'documents of mean {hw.mean_doc_len:g} tokens, masked | ' if hw.mean_doc_len else ''}"
            f"{considered} layouts considered, {0 if results.fits_nothing else len(results)} fit, "
            f"searched in {elapsed:.2f} s\n"
        )
        if results.fits_nothing:
            print("fits: false -- the fixed layout does not fit; what it would need:\n")
        print(output.table(results, args.top, results.refused))
        print("\nthe fixed layout, explained:" if results.fits_nothing else "\nbest layout, explained:")
        print(output.explain(results[0], hw.hbm_gib))
        if islands is not None:
            print(diloco_costs.describe(islands, args))
    if args.emit_config and results.fits_nothing:
        raise ConfigError(f"--emit-config: the fixed layout does not fit ({results[0].overflow})")
    if args.emit_config:
        chosen = next((e for e in results if output.runnable(e)), None)
        if chosen is None:
            raise ConfigError(
                "no fitting layout is runnable by this version of meshforge train: "
                f"{results[0].not_runnable}; change the fixed choices or use more GPUs"
            )
        Path(args.emit_config).write_text(output.emitted_config(chosen, shape, seq, gb, precision, preset))
        if not args.json:
            rank = results.index(chosen) + 1
            print(f"\nwrote {args.emit_config}: layout #{rank}" + (" (the best runnable one)" if rank > 1 else ""))
    return 0
