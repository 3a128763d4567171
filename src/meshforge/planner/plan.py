"""``meshforge plan``: read the model, training and cluster from the command line (or a
train config), search, and print or write the answer."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshforge.config import load_config, tomllib
from meshforge.errors import ConfigError
from meshforge.layout import open_layout
from meshforge.models.presets import model_shape
from meshforge.models.shape import ModelShape
from meshforge.planner import diloco_costs, output
from meshforge.planner.hardware import PRESETS, Hardware, get_hardware
from meshforge.planner.search import OFFLOAD, Ranked, search
from meshforge.planner.shape import check_flags, from_preset, named


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a preset, explicit shape, or --config)")
    m.add_argument("--model", help="preset name, e.g. llama3.1-405b")
    m.add_argument("--config", help="a meshforge train config (e.g. a run's config.toml): model, batch, degrees")
    for k in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "vocab", "max-positions"):
        m.add_argument(f"--{k}", type=int)
    m.add_argument("--mlp", choices=["swiglu", "gelu"], default="swiglu")
    m.add_argument("--tie-embeddings", action="store_true")
    m.add_argument(
        "--attention",
        choices=["flash", "materialized"],
        default="flash",
        help="attention kernel: fused (flash, meshforge's) or scores written out (Megatron-LM 2021/22)",
    )
    add_moe_arguments(m)
    t = p.add_argument_group("training")
    t.add_argument("--seq-len", type=int, help="tokens per sequence (default: the --config's, else 4096)")
    t.add_argument(
        "--global-batch",
        type=int,
        help="sequences per optimizer step (default: the --config's, else one per GPU, i.e. --gpus)",
    )
    t.add_argument("--precision", choices=["bf16", "fp32", "fp8"])
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--gpu",
        default="h100-sxm",
        metavar="PRESET",
        help=f"hardware preset, one of: {', '.join(PRESETS)} (default: h100-sxm)",
    )
    c.add_argument("--hardware", help="a profile written by meshforge calibrate (overrides --gpu)")
    c.add_argument("--gpus", type=int)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--inter-node-bw", type=float, help="network bandwidth per GPU in GB/s")
    c.add_argument(
        "--comm-overlap",
        type=float,
        help="share of data-parallel traffic that hides under compute (default: the hardware's; 0 for a framework "
        "that reduces gradients only after backward, e.g. Megatron-LM before 2023)",
    )
    _add_fixed_arguments(p)
    diloco_costs.add_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10)
    o.add_argument("--json", action="store_true")
    o.add_argument("--emit-config", metavar="FILE", help="write a meshforge train config for the best runnable layout")


def _add_fixed_arguments(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fixed choices (the rest is searched)")
    for k in ("tp", "pp", "dp", "cp", "zero", "micro-batch", "virtual-stages"):
        f.add_argument(f"--{k}", type=int)
    f.add_argument(
        "--ep",
        type=int,
        help="expert-parallel degree (MoE): experts split over ep of the dp x cp ranks, FSDP over the rest; "
        "searched over the divisors of --experts when left out",
    )
    f.add_argument("--recompute", choices=["none", "selective", "full"])
    f.add_argument("--schedule")
    f.add_argument(
        "--offload",
        choices=list(OFFLOAD),
        help="CPU offload of the sharded model states (FSDP2, ZeRO-2/3; parallel.offload): auto (default) searches "
        "it only when nothing fits without it, none never, cpu always",
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
    m.add_argument("--experts", type=int, help="routed experts per MoE block (mixture of experts; 0: dense)")
    m.add_argument("--top-k", type=int, help="experts each token is sent to (default 2)")
    m.add_argument("--moe-ffn-hidden", type=int, help="hidden size of one expert (default: --ffn-hidden)")
    m.add_argument("--shared-experts", type=int, help="always-on experts of --moe-ffn-hidden each (default 0)")
    m.add_argument(
        "--capacity-factor",
        type=float,
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
    if args.config:
        return _from_config(args.config)
    if args.model:
        return from_preset(args.model), {}, args.model
    return _from_flags(args), {}, None


def _from_config(path: str) -> tuple[ModelShape, dict, str | None]:
    """A run config's model, and as fixed choices what the file itself sets (a run's resolved
    config.toml sets everything)."""
    cfg = load_config(path, {})
    shape = named(model_shape(cfg.model), Path(path).stem)
    preset = cfg.model.preset if not any(getattr(cfg.model, k, None) for k in ("hidden", "layers")) else None
    raw = _raw_toml(path)
    par, tr = raw.get("parallel", {}), raw.get("train", {})
    p, t = cfg.parallel, cfg.train
    from_cfg = {"seq_len": t.seq_len, "global_batch": t.global_batch_size}
    if "precision" in tr and t.precision != "auto":
        from_cfg["precision"] = t.precision
    from_cfg |= {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if k in par and getattr(p, k) > 0}
    from_cfg |= {k: getattr(p, k) for k in ("zero_stage", "offload") if k in par}
    if "dp_shard" in par and "dp_replicate" in par and p.dp_shard > 0 and p.dp_replicate > 0:
        from_cfg["dp_shard"] = p.dp_shard * p.dp_replicate
    if "pp_schedule" in par and p.pp > 1:
        from_cfg["pp_schedule"] = {"interleaved": "interleaved_1f1b"}.get(p.pp_schedule, p.pp_schedule)
    if "pp_virtual_stages" in par and p.pp > 1 and p.pp_virtual_stages > 1:
        from_cfg["pp_virtual_stages"] = p.pp_virtual_stages
    dp = from_cfg.get("dp_shard")
    if p.pp > 1 and dp and p.num_microbatches:  # the schedule's micro-batches
        from_cfg["micro_batch_size"] = max(1, t.global_batch_size // dp // p.num_microbatches)
    elif tr.get("micro_batch_size"):
        from_cfg["micro_batch_size"] = t.micro_batch_size
    elif "micro_batch_size" in tr and dp:  # 0: the whole local batch in one pass
        from_cfg["micro_batch_size"] = max(1, t.global_batch_size // dp)
    if "activation_checkpoint" in tr:
        from_cfg["activation_checkpoint"] = t.activation_checkpoint
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
    hw = get_hardware(args.gpu, args.hardware)
    if args.inter_node_bw:
        hw.inter_bw = args.inter_node_bw * 1e9
    if args.comm_overlap is not None:
        hw.comm_overlap = min(1.0, max(0.0, args.comm_overlap))
    if args.gpus is None or args.gpus < 1:
        raise ConfigError("--gpus N (the cluster size, >= 1) is required")
    seq = args.seq_len or dflt.get("seq_len") or 4096
    gb = args.global_batch or dflt.get("global_batch") or max(args.gpus, 1)
    precision = args.precision or dflt.get("precision") or ("fp32" if hw.name == "cpu" else "bf16")

    def pick(name: str, cli_name: str | None = None):
        v = getattr(args, cli_name or name)
        return v if v is not None else dflt.get(name)

    fixed = open_layout(
        **{key: pick(key, flag) for key, flag in FIXED_FLAGS.items()},
        sequence_parallel=not args.no_sequence_parallel,
    )
    results, considered = search(shape, hw, args.gpus, args.gpus_per_node, gb, seq, precision, fixed)
    return Planned(results, considered, shape, hw, gb, seq, precision, preset)


def parse_plan_args(argv: list[str]) -> argparse.Namespace:
    """``meshforge plan`` arguments from a list (for callers that plan in-process)."""
    p = argparse.ArgumentParser(prog="meshforge plan")
    add_arguments(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
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
        moe = "" if active == shape.num_params() else f" ({active / 1e9:.2f}B active, {shape.num_experts} experts)"
        print(
            f"{shape.name}: {shape.num_params() / 1e9:.2f}B parameters{moe} | {args.gpus} x {hw.name} "
            f"({args.gpus_per_node} per node, {hw.source}) | global batch {gb} x {seq} tokens, {precision} | "
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
        Path(args.emit_config).write_text(output.train_config(chosen, shape, seq, gb, precision, preset))
        if not args.json:
            rank = results.index(chosen) + 1
            print(f"\nwrote {args.emit_config}: layout #{rank}" + (" (the best runnable one)" if rank > 1 else ""))
    return 0
