"""The explorer's answers, all from the planner: one layout's memory, communication and step
time (``planner.estimate``), the rules it breaks (``parallel.rules``), the best layouts for the
same model and cluster (``planner.search``) and the train config of one (``planner.output``).
Nothing here models memory or time itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from meshforge.config.layout import Layout, open_layout
from meshforge.errors import ConfigError
from meshforge.models.presets import PRESETS as MODEL_PRESETS
from meshforge.models.shape import ModelShape
from meshforge.parallel import rules
from meshforge.parallel.rules import Batch, Problem, resolve_degrees
from meshforge.planner import output
from meshforge.planner.estimate import Estimate, estimate, plan_layout, run_layout
from meshforge.planner.hardware import PRESETS as GPU_PRESETS
from meshforge.planner.hardware import Hardware
from meshforge.planner.model_flags import from_preset
from meshforge.planner.offload_costs import can_offload
from meshforge.planner.search import search

from .params import SPECS, BadRequest, hardware_of, shape_of

MAX_SEARCH_GPUS = 65536  # how far the "smallest cluster that fits" hint looks


def layout_of(v: dict[str, Any]) -> tuple[Layout | None, list[dict[str, str]]]:
    """The layout the degrees and options describe (dp = gpus / (tp x pp x cp)), and the rules
    it breaks in the layout rules' own words; no layout when dp or the micro-batches are not whole.
    An ep the expert rules refuse (dense model, ep not dividing the experts or dp x cp) is a
    refused parameter (BadRequest), in the rule's words."""
    try:
        degrees = resolve_degrees(Layout(pp=v["pp"], dp_shard=-1, cp=v["cp"], tp=v["tp"], ep=v["ep"] or 1), v["gpus"])
    except ConfigError as e:
        return None, [{"key": "parallel", "message": str(e), "kind": "invalid"}]
    pp, dp = degrees.pp, degrees.dp_shard
    local = v["global_batch"] // dp
    mb = v["micro_batch"] or max(1, local)  # 0: the whole per-rank batch, as train.micro_batch_size = 0
    lay = plan_layout(
        degrees.tp,
        pp,
        dp,
        cp=degrees.cp,
        ep=degrees.ep,
        zero_stage=v["zero"] if dp * degrees.cp > 1 else 0,
        micro_batch_size=mb,
        num_microbatches=max(1, local // mb),
        activation_checkpoint=v["recompute"],
        pp_virtual_stages=v["virtual_stages"] if pp > 1 else 1,
        pp_schedule=v["schedule"] if pp > 1 else "none",
        sequence_parallel=v["sp"],
        offload=v["offload"],
    )
    shape = shape_of(v)
    found = rules.problems(run_layout(lay), shape, Batch(v["seq_len"], v["global_batch"], v["gpus_per_node"]))
    _refuse_ep(found)
    problems = [asdict(p) for p in found]
    whole = v["global_batch"] % dp == 0 and local % mb == 0
    return (lay if whole else None), problems


def _refuse_ep(found: list[Problem]) -> None:
    """An invalid ep is answered 400 with the expert rule's own message (parallel/rules.py)."""
    refused = [p.message for p in found if p.key == "parallel.ep" and p.kind == "invalid"]
    if refused:
        raise BadRequest("; and ".join(refused))


def _check_best_ep(shape: ModelShape, v: dict[str, Any]) -> None:
    """A fixed ep for the search, put to the layout rules' judge of a partial layout: a dense
    model, or an ep that does not divide the experts, is refused in the rule's words."""
    _refuse_ep(rules.partial_problems(open_layout(ep=v["ep"]), shape, v["gpus"], v["gpus_per_node"]))


def _estimate_json(e: Estimate, hw: Hardware) -> dict[str, Any]:
    """One estimate in the page's terms: memory bars, communication by axis, step breakdown."""
    t, step = e.time, e.step_time_s
    recompute = e.budget["recompute"] * step
    exposed = t["tp_comm"] + t["cp_comm"] + t["pp_p2p"] + t["ep_a2a"] + t["dp_comm_exposed"] + t["offload_copy"]
    comm = {"tp": t["tp_comm"], "cp": t["cp_comm"], "pp": t["pp_p2p"], "dp": t["dp_comm_total"]}
    comm_exposed = {"tp": t["tp_comm"], "cp": t["cp_comm"], "pp": t["pp_p2p"], "dp": t["dp_comm_exposed"]}
    if e.layout.ep > 1:  # the expert all-to-alls (dispatch and combine) sit on the critical path
        comm["ep"] = comm_exposed["ep"] = t["ep_a2a"]
    return {
        "memory_gib": dict(e.memory),
        "host_memory_gib": dict(e.host_memory),
        "hbm_gib": hw.hbm_gib,
        "fits": e.fits,
        "overflow": e.overflow,
        "comm_s": comm,
        "comm_exposed_s": comm_exposed,
        "ep_a2a_s": t["ep_a2a"],
        "step_s": {
            "compute": t["gemm"] + t["non_gemm"] - recompute,
            "recompute": recompute,
            "exposed_comm": exposed,
            "bubble": t["bubble"],
            "optimizer": t["optimizer"],
        },
        "step_time_s": step,
        "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
        "mfu": e.mfu,
        "hfu": e.hfu,
    }


def _context(shape: ModelShape, hw: Hardware, v: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {"name": shape.name, "num_params": shape.num_params(), **_shape_fields(shape)},
        "cluster": {
            "gpu": hw.name,
            "gpus": v["gpus"],
            "gpus_per_node": v["gpus_per_node"],
            "hbm_gib": hw.hbm_gib,
            "peak_tflops": hw.peak(v["precision"]) / 1e12,
            "intra_bw_gbs": hw.intra_bw / 1e9,
            "inter_bw_gbs": hw.inter_bw / 1e9,
        },
        "training": {"seq_len": v["seq_len"], "global_batch": v["global_batch"], "precision": v["precision"]},
    }


def evaluate(v: dict[str, Any]) -> dict[str, Any]:
    """One layout: the planner's estimate and the rules it breaks."""
    shape, hw = shape_of(v), hardware_of(v)
    lay, problems = layout_of(v)
    out = _context(shape, hw, v)
    out["layout"] = asdict(lay) if lay else None
    out["problems"] = problems
    out["exists"] = lay is not None and not any(p["kind"] == "invalid" for p in problems)
    out["runnable"] = lay is not None and not problems
    out["estimate"] = None
    if lay is not None:
        e = estimate(shape, lay, v["seq_len"], v["global_batch"], v["precision"], hw, v["gpus_per_node"])
        out["estimate"] = _estimate_json(e, hw)
    out["verdict"] = verdict(out)
    return out


def verdict(a: dict[str, Any]) -> dict[str, Any]:
    """The view's one verdict, fit and rules together: ``ok`` only when the layout exists, no rule
    refuses it and it fits; otherwise the text names what wins (a broken rule before the memory)."""
    e, probs = a["estimate"], a["problems"]
    if a["layout"] is None:
        why = probs[0]["message"] if probs else "the global batch does not split into whole micro-batches"
        return {"ok": False, "kind": "no_layout", "text": f"no such layout: {why}"}
    rule = probs[0]["message"] if probs else ""
    invalid = any(p["kind"] == "invalid" for p in probs)
    if e["fits"] and not probs:
        text = f"fits ({e['memory_gib']['total']:.1f} of {e['hbm_gib']:.0f} GiB) and meshforge train runs it"
        return {"ok": True, "kind": "ok", "text": text}
    if not probs:
        return {
            "ok": False,
            "kind": "does_not_fit",
            "text": f"runs under meshforge train's rules but does not fit: {e['overflow']}; "
            "try a higher ZeRO stage, more tp or pp, recompute, or a best layout below",
        }
    what = "breaks a layout rule" if invalid else "meshforge train does not run it"
    total = f"{e['memory_gib']['total']:.1f} GiB of {e['hbm_gib']:.0f} GiB"
    fit = f"it would fit ({total})" if e["fits"] else f"it does not fit either ({total})"
    return {"ok": False, "kind": "rules", "text": f"{what}: {rule}; {fit}"}


def best(
    v: dict[str, Any], deadline: float | None = None, cancelled: Callable[[], bool] | None = None
) -> dict[str, Any]:
    """The planner's fastest fitting layouts for this model, cluster and batch (degrees free;
    ep too unless given). ``deadline``/``cancelled`` end the search early (``partial``)."""
    shape, hw = shape_of(v), hardware_of(v)
    if v["ep"] is not None:
        _check_best_ep(shape, v)
    out = _context(shape, hw, v)
    try:
        ranked, considered = search(
            shape,
            hw,
            v["gpus"],
            v["gpus_per_node"],
            v["global_batch"],
            v["seq_len"],
            v["precision"],
            open_layout(ep=v["ep"]),
            max_gpus=max(v["gpus"], MAX_SEARCH_GPUS),
            deadline=deadline,
            cancelled=cancelled,
        )
    except ConfigError as e:
        return out | {"layouts": [], "considered": 0, "message": str(e), "partial": "deadline" in str(e)}
    rows = []
    for e in ranked[: v["top"]]:
        row = e.as_json()
        row["memory_total_gib"] = e.memory["total"]
        rows.append(row)
    partial = ranked.partial
    note = f"the search stopped at its time budget: the fastest of the first {considered} layouts" if partial else ""
    return out | {"layouts": rows, "considered": considered, "message": note, "partial": partial}


def config_file(v: dict[str, Any]) -> str:
    """The ``meshforge train`` TOML of this layout (``meshforge plan --emit-config``'s writer);
    refused when train would not run it or it does not fit."""
    shape, hw = shape_of(v), hardware_of(v)
    lay, problems = layout_of(v)
    if lay is None or problems:
        raise BadRequest("this layout does not run: " + (problems[0]["message"] if problems else "no layout"))
    e = estimate(shape, lay, v["seq_len"], v["global_batch"], v["precision"], hw, v["gpus_per_node"])
    if not e.fits:
        raise BadRequest(f"this layout does not fit: it {e.overflow} per GPU; pick one that fits")
    preset = None if v["model"] == "custom" else v["model"]
    return output.emitted_config(e, shape, v["seq_len"], v["global_batch"], v["precision"], preset)


def _shape_fields(shape: ModelShape) -> dict[str, Any]:
    return {
        "layers": shape.layers,
        "hidden": shape.hidden,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "ffn_hidden": shape.ffn_hidden,
        "vocab": shape.vocab_size,
        "tie_embeddings": shape.tie_embeddings,
        "num_experts": shape.num_experts,
        "experts_per_token": shape.experts_per_token,
    }


def presets() -> dict[str, Any]:
    """What the page's menus offer: model shapes, GPU figures, every parameter's range."""
    return {
        "models": {
            name: {"num_params": (s := from_preset(name)).num_params(), **_shape_fields(s)} for name in MODEL_PRESETS
        },
        "gpus": {
            name: {
                "hbm_gib": hw.hbm_gib,
                "peak_tflops": {k: f / 1e12 for k, f in hw.peak_flops.items()},
                "intra_bw_gbs": hw.intra_bw / 1e9,
                "inter_bw_gbs": hw.inter_bw / 1e9,
                "can_offload": can_offload(hw),
            }
            for name, hw in GPU_PRESETS.items()
        },
        "params": {
            k: {
                "kind": s.kind,
                "default": s.default,
                "min": s.lo,
                "max": s.hi,
                "also": list(s.also),
                "key": s.key,
                "choices": list(s.choices),
                "help": s.help,
            }
            for k, s in SPECS.items()
        },
    }
