"""What ``meshforge plan`` prints: a ranked table, the best layout explained, JSON, and a
runnable train config."""

from __future__ import annotations

import json

from meshforge.config import build, to_toml
from meshforge.models.shape import ModelShape
from meshforge.planner.estimate import Estimate

COLUMNS = (
    "columns: tp, pp, dp, cp: tensor-, pipeline-, data- and context-parallel degrees; ep: expert-parallel degree "
    "(MoE: experts split over ep of the dp x cp ranks); zero: ZeRO stage (0: DDP, "
    "3: fully sharded); mb: micro-batch size (sequences per forward pass); m: micro-batches per step on each "
    "data-parallel rank (gradient accumulation, or the pipeline's micro-batches); recompute: activation "
    "recomputation; schedule: pipeline schedule (v: model chunks per rank); mem GiB: predicted peak memory per GPU; "
    "step s: predicted time per optimizer step; MFU: model FLOPs (6N + attention) per second over the peak; HFU: the "
    "same counting recomputed FLOPs; host GiB (shown when a row offloads): the model states CPU offload keeps in "
    "host memory per GPU (parallel.offload = cpu; -: not offloaded); *: not runnable by meshforge train; "
    "!: does not fit"
)

TIME_PARTS = (
    "gemm",
    "non_gemm",
    "tp_comm",
    "cp_comm",
    "pp_p2p",
    "ep_a2a",
    "dp_comm_exposed",
    "offload_copy",
    "bubble",
    "optimizer",
)


def count(n: float) -> str:
    """A parameter count people read: 8.03B, 0.92M (the debug preset's was "0.00B"), 12.35K."""
    for div, unit in ((1e9, "B"), (1e5, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / (1e6 if unit == 'M' else div):.2f}{unit}"
    return f"{n:.0f}"


def table(results: list[Estimate], top: int, refused: list[Estimate] = ()) -> str:
    """The ranking (each column as wide as its widest cell, so long schedule names never break it);
    then the layouts meshforge train does not run yet that are faster than row 1, with the reason.
    A host-memory column appears when some row offloads its model states to the CPU."""
    shown = results[:top]
    offloads = any(e.layout.offload == "cpu" for e in shown)
    head = ["#", "tp", "pp", "dp", "cp", "ep", "zero", "mb", "m", "recompute", "schedule", "mem GiB"]
    head += ["host GiB"] if offloads else []
    head += ["step s", "tok/s/gpu", "MFU", "HFU", ""]
    cells, notes = [head], []
    for i, e in enumerate(shown, 1):
        cells.append(_row(i, e, offloads))
        if not e.fits:
            notes.append(f"  ! #{i} fits: false -- {e.overflow}")
        if e.not_runnable:
            notes.append(f"  * #{i} is not runnable by meshforge train: {e.not_runnable}")
    widths = [max(len(r[c]) for r in cells) for c in range(len(head))]
    lines = [" ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines + notes + _faster(results, refused) + [COLUMNS])


def _row(i: int, e: Estimate, offloads: bool) -> list[str]:
    L = e.layout
    sched = "-" if L.pp == 1 else L.pp_schedule + (f" v={L.pp_virtual_stages}" if L.pp_virtual_stages > 1 else "")
    flags = " ".join(f for f, on in (("*", e.not_runnable), ("!", not e.fits)) if on)
    cols = [i, L.tp, L.pp, L.dp, L.cp, L.ep, L.zero_stage, L.micro_batch_size, L.num_microbatches]
    return (
        [str(c) for c in cols]
        + [L.activation_checkpoint, sched, f"{e.memory['total']:.1f}"]
        + ([_host(e)] if offloads else [])
        + [f"{e.step_time_s:.3f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{100 * e.mfu:.1f}%", f"{100 * e.hfu:.1f}%"]
        + [f" {flags}" if flags else ""]
    )


def _faster(results: list[Estimate], refused: list[Estimate]) -> list[str]:
    """Refused layouts faster than row 1 as printed (a tie at the shown precision is not faster)."""
    best = round(results[0].tokens_per_s_per_gpu) if results else 0
    faster = [e for e in refused if round(e.tokens_per_s_per_gpu) > best][:3]
    if not faster:
        return []
    notes = ["faster layouts meshforge train does not run (not ranked):"]
    for e in faster:
        L = e.layout
        sched = L.pp_schedule + (f" v={L.pp_virtual_stages}" if L.pp_virtual_stages > 1 else "")
        notes.append(
            f"  tp {L.tp} pp {L.pp} dp {L.dp} cp {L.cp} ep {L.ep} zero {L.zero_stage} mb {L.micro_batch_size} "
            f"recompute {L.activation_checkpoint} {sched}: "
            f"{e.tokens_per_s_per_gpu:,.0f} tok/s/gpu -- {e.not_runnable}"
        )
    return notes


def _host(e: Estimate) -> str:
    return f"{e.host_memory['total']:.1f}" if e.host_memory else "-"


# the memory breakdown's parts, in the order shown (planner/memory.py says what each holds); zero parts
# after the model states are left out (no weight copies under FSDP2, gradients at the peak, ...)
MEMORY_PARTS = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "loss",
    "weight_copies",
    "buffers",
    "grads_not_at_peak",
    "reserve",
)


def explain(e: Estimate, hbm_gib: float) -> str:
    m, t, b = e.memory, e.time, e.budget
    offload = e.layout.offload == "cpu"
    lines = [
        "memory per GPU (GiB): "
        + ", ".join(f"{k} {m[k]:.2f}" for k in MEMORY_PARTS if k in m and (m[k] or k in MEMORY_PARTS[:4]))
        + f" = {m['total']:.2f} of {hbm_gib:.0f}"
        + (" (fits)" if e.fits else f" -- fits: false, {e.overflow}"),
        "time per step (s): "
        + ", ".join(f"{k} {t[k]:.4f}" for k in TIME_PARTS if _shown(k, e))
        + f" -> {e.step_time_s:.4f} (dp traffic {t['dp_comm_total']:.4f} s, mostly hidden under compute"
        + (f"; tp traffic hidden by async TP {t['tp_comm_hidden']:.4f} s" if t.get("tp_comm_hidden") else "")
        + (f"; all-to-alls hidden by ep_chunks {t['ep_a2a_hidden']:.4f} s" if t.get("ep_a2a_hidden") else "")
        + ")",
        "where the time goes (fractions of the step): "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in b.items() if k != "offload_exposed" or offload),
    ]
    if offload:
        h = e.host_memory
        lines.insert(
            1,
            "CPU offload: host memory per GPU (GiB): "
            + ", ".join(f"{k} {h[k]:.2f}" for k in ("params", "grads", "optimizer"))
            + f" = {h['total']:.2f} ({h['per_node']:.1f} per node); host-link copies {t['offload_copy_total']:.4f} s "
            f"per step ({t['offload_copy']:.4f} s exposed), optimizer step on the CPU {t['optimizer']:.4f} s",
        )
    return "\n".join(lines)


def _shown(part: str, e: Estimate) -> bool:
    """Time parts shown only where they can be nonzero: experts' all-to-all, offload copies."""
    if part == "ep_a2a":
        return e.layout.ep > 1
    return part != "offload_copy" or e.layout.offload == "cpu"


def as_json(results: list[Estimate], top: int, shape: ModelShape, considered: int, refused: list[Estimate] = ()) -> str:
    return json.dumps(
        {
            "model": shape.name,
            "num_params": shape.num_params(),
            "considered": considered,
            "fits": any(e.fits for e in results),
            "layouts": [e.as_json() for e in results[:top]],
            "not_runnable": [e.as_json() for e in refused[:top]],
        },
        indent=1,
    )


def runnable(e: Estimate) -> bool:
    """Whether `meshforge train` runs this layout (the layout rules' verdict, set by the search)."""
    return not e.not_runnable


def emitted_config(
    e: Estimate, shape: ModelShape, seq: int, global_batch: int, precision: str, preset: str | None
) -> str:
    """A `meshforge train` TOML for this layout, written by the config's own writer: what was
    priced is what train runs (dp ranks shard under ZeRO-2/3, else replicate)."""
    L = e.layout
    values: dict[str, object] = {"model.preset": preset} if preset else _shape_values(shape, seq)
    if preset and shape.max_seq_len < seq:  # a longer context than the preset's: train refuses it otherwise
        values["model.max_seq_len"] = seq
    values |= {f"parallel.{k}": getattr(L, k) for k in ("tp", "cp", "ep", "zero_stage", "sequence_parallel")}
    values |= {"parallel.dp_shard": L.dp, "parallel.dp_replicate": 1}
    if L.pp > 1:  # the schedule runs the micro-batches
        pipe = ("pp", "pp_schedule", "pp_virtual_stages", "num_microbatches")
        values |= {f"parallel.{k}": getattr(L, k) for k in pipe}
        if L.pp_layers:
            values["parallel.pp_layers"] = tuple(L.pp_layers)
    if L.offload == "cpu":  # FSDP2's CPU offload (parallel/rules.py)
        values["parallel.offload"] = "cpu"
    if L.async_tp:
        values["parallel.async_tp"] = True
    micro = 0 if L.pp > 1 else L.micro_batch_size
    values |= {"train.seq_len": seq, "train.global_batch_size": global_batch, "train.micro_batch_size": micro}
    values |= {"train.precision": precision, "train.activation_checkpoint": L.activation_checkpoint}
    head = (
        f"# written by meshforge plan: predicted {e.step_time_s:.3f} s/step, "
        f"{e.tokens_per_s_per_gpu:.0f} tokens/s/GPU, MFU {100 * e.mfu:.1f}%, {e.memory['total']:.1f} GiB/GPU\n"
        f"# run with: meshforge train --config THIS_FILE --nproc {L.tp * L.dp * L.pp * L.cp} (or torchrun)\n\n"
    )
    return head + to_toml(build(values), only=set(values))


def _shape_values(shape: ModelShape, seq: int) -> dict[str, object]:
    """An explicit shape's config keys: the dense ones, and the MoE ones where it has experts."""
    keys = ["hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab_size", "tie_embeddings"]
    if shape.head_dim != shape.hidden // shape.heads:
        keys.append("head_dim")
    if shape.qk_norm:
        keys.append("qk_norm")
    if shape.num_experts:
        keys += ["num_experts", "experts_per_token", "moe_ffn_hidden", "num_shared_experts", "moe_interval"]
        keys += ["first_dense_layers"] + (["capacity_factor"] if shape.capacity_factor > 0 else [])
    return {f"model.{k}": getattr(shape, k) for k in keys} | {"model.max_seq_len": max(seq, 1)}
