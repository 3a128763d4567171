"""``meshforge plan``: read the model, training and cluster from the command line (or a
train config), search, and print or write the answer."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshforge.config import load_config
from meshforge.config.layout import Layout, open_layout
from meshforge.config.load import MAX_CONFIG_BYTES
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape
from meshforge.planner import diloco_costs, output
from meshforge.planner.hardware import ATTENTION_KERNELS, THIS_CPU, Hardware, get_hardware, preset_for_device
from meshforge.planner.model_flags import check_flags, from_preset, named
from meshforge.planner.plan_args import FIXED_KEYS, MOE_KEYS, SHAPE_FLAGS, add_arguments, attr, dest
from meshforge.planner.search import Ranked, search
from meshforge.safeio.files import read_regular
from meshforge.safeio.parse import loads_toml


def _with_moe_flags(shape: ModelShape, args: argparse.Namespace) -> tuple[ModelShape, bool]:
    """The shape with the MoE flags given laid over it (re-checked), and whether any was given."""
    given = {attr(k): getattr(args, dest(k)) for k in MOE_KEYS if getattr(args, dest(k), None) is not None}
    if not given:
        return shape, False
    return check_flags(ModelShape(**{**shape.__dict__, **given})), True


def _model_of(args: argparse.Namespace) -> tuple[ModelShape, dict, str | None]:
    """The model, training defaults taken from --config, and the preset name (if any)."""
    given = [flag for flag in SHAPE_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
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
    from_cfg["loss_chunk_size"] = t.loss_chunk_size  # the memory model's loss part (planner/memory.py)
    from_cfg["mixed_precision"] = t.mixed_precision  # bf16 by autocast or cast once (auto: by the device)
    if "precision" in tr and t.precision != "auto":
        from_cfg["precision"] = t.precision
    from_cfg |= {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if k in par and getattr(p, k) > 0}
    fixed_keys = ("zero_stage", "offload", "async_tp", "ep_chunks", "ddp_bucket_mb")
    from_cfg |= {k: getattr(p, k) for k in fixed_keys if k in par}
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
    """The TOML at ``path`` read as every config is (safeio: a regular file, bounded, depth-limited)."""
    raw = read_regular(path, MAX_CONFIG_BYTES, ConfigError, "pass a TOML config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not a UTF-8 TOML file; pass a text TOML config") from None
    return loads_toml(text, f"--config {path}", ConfigError, "pass a TOML config such as a run's config.toml")


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
    ranks = min(args.gpus or 1, args.gpus_per_node)  # (this CPU's figures are per rank: cores / local ranks)
    hw = get_hardware(args.gpu or _device_preset(dflt.get("device", "")), args.hardware, ranks)
    if args.inter_node_bw is not None:
        hw.inter_bw = args.inter_node_bw * 1e9
    hw.eager = bool(args.eager) if args.eager is not None else not dflt.get("compile", True)
    hw.loss_chunk_size = dflt.get("loss_chunk_size", hw.loss_chunk_size)
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
    precision = args.precision or dflt.get("precision") or "auto"
    precision = ("fp32" if hw.is_cpu() else "bf16") if precision == "auto" else precision

    def pick(dotted: str):
        v = getattr(args, dest(dotted))
        if v == -1:  # a degree of -1 is inferred, as in a config: the search finds it
            return None
        return v if v is not None else dflt.get(attr(dotted))

    fixed = open_layout(
        **{attr(k): pick(k) for k in FIXED_KEYS},
        sequence_parallel=not args.no_sequence_parallel,
        async_tp=bool(args.tp_overlap or dflt.get("async_tp")),
        ep_chunks=dflt.get("ep_chunks") or Layout.ep_chunks,
        ddp_bucket_mb=dflt.get("ddp_bucket_mb") or Layout.ddp_bucket_mb,
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
    """The hardware for --config's device when --gpu is not given: this machine's CPU, measured
    (``this-cpu``), for a CPU run; this machine's GPU for a CUDA run where one is visible, else an H100."""
    if device == "cpu":
        return THIS_CPU
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
