"""Every parameter the explorer's API accepts: its type, range and default, and the check
that turns a query string into a model, a cluster and a layout or refuses it with a message.

A parameter that sets a config key (``SHARED``: parameter -> key) takes its help, range and
words from that key's field, so the explorer accepts and refuses what a train config and
``meshforge plan`` do (tests/unit/test_one_vocabulary.py walks them); its default is the
explorer's (a view of a model on a cluster, not a run). The explorer's own parameters (the
cluster, the hardware's figures, how many layouts to list) keep caps of their own: they keep
one request (a search above all) to about a second and nonsense out of the planner.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from meshforge.config.keys import keys, plain_text
from meshforge.errors import suggest
from meshforge.models.presets import PRESETS as MODEL_PRESETS
from meshforge.models.shape import ModelShape
from meshforge.planner.estimate import SCHEDULES, V_SCHEDULES
from meshforge.planner.hardware import PRESETS as GPU_PRESETS
from meshforge.planner.hardware import Hardware, get_hardware
from meshforge.planner.model_flags import check_flags, from_preset
from meshforge.planner.offload_costs import can_offload
from meshforge.ranges import Span

MAX_GPUS = 16384
SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "tie_embeddings")


class BadRequest(ValueError):
    """A parameter the API refuses (answered as HTTP 400 with this message)."""


@dataclass(frozen=True)
class Spec:
    kind: str  # "int" | "float" | "bool" | "choice"
    default: Any = None
    lo: float = 0
    hi: float = 0
    choices: tuple[str, ...] = ()
    help: str = ""
    key: str = ""  # the config key it sets ("": the explorer's own)
    also: tuple[float, ...] = ()  # values allowed outside [lo, hi] (a -1 degree: inferred)

    @property
    def span(self) -> Span:
        return Span(self.lo, self.hi, also=self.also)


# parameter -> the config key it sets: its help, range and words are the key's field's
SHARED = {
    **{k: f"model.{k}" for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "tie_embeddings")},
    **{"vocab": "model.vocab_size", "seq_len": "train.seq_len", "global_batch": "train.global_batch_size"},
    **{"precision": "train.precision", "micro_batch": "train.micro_batch_size"},
    **{"recompute": "train.activation_checkpoint", "zero": "parallel.zero_stage", "sp": "parallel.sequence_parallel"},
    **{k: f"parallel.{k}" for k in ("tp", "pp", "cp", "ep", "offload")},
    **{"schedule": "parallel.pp_schedule", "virtual_stages": "parallel.pp_virtual_stages"},
}
# the choices of a key the config types as a plain string (the layout rules judge its words)
OWN_CHOICES = {"parallel.pp_schedule": SCHEDULES + V_SCHEDULES}


def shared(name: str, default: Any, note: str = "") -> Spec:
    """The spec of a parameter that sets a config key: kind, range, words and help from its field."""
    k = keys()[SHARED[name]]
    words = OWN_CHOICES.get(k.dotted) or k.choices
    kind = "bool" if k.type is bool else "choice" if words else "int" if k.type is int else "float"
    span = k.span or Span(0, 0)
    if span.lo_open or span.hi_open:  # (no shared number has an open end; the page checks [min, max])
        raise TypeError(f"{k.dotted}: the explorer takes closed ranges")
    text = f"{plain_text(k.help)} ({k.dotted}{'; ' + note if note else ''})"
    return Spec(kind, default, span.lo, span.hi, tuple(words), text, k.dotted, tuple(span.also))


SPECS: dict[str, Spec] = {
    "model": Spec("choice", "llama3.1-8b", choices=(*MODEL_PRESETS, "custom"), help="model preset, or custom"),
    **{k: shared(k, None, "model=custom") for k in ("layers", "hidden", "heads", "ffn_hidden", "vocab")},
    "kv_heads": shared("kv_heads", None, "model=custom; default: heads"),
    "tie_embeddings": shared("tie_embeddings", False, "model=custom"),
    "gpu": Spec("choice", "h100-sxm", choices=tuple(GPU_PRESETS), help="GPU preset"),
    "hbm_gib": Spec("float", None, 1, 4096, help="memory per GPU in GiB (overrides the preset)"),
    "peak_tflops": Spec("float", None, 0.01, 100000, help="dense peak at the chosen precision, TFLOP/s"),
    "intra_bw_gbs": Spec("float", None, 0.1, 100000, help="bandwidth per GPU inside a node, GB/s"),
    "inter_bw_gbs": Spec("float", None, 0.1, 100000, help="bandwidth per GPU across nodes, GB/s"),
    "gpus": Spec("int", 8, 1, MAX_GPUS, help="GPUs in the cluster"),
    "gpus_per_node": Spec("int", 8, 1, 64, help="GPUs per node"),
    "seq_len": shared("seq_len", 4096),
    "global_batch": shared("global_batch", None, "default: gpus"),
    "precision": shared("precision", "bf16"),
    **{k: shared(k, 1) for k in ("tp", "pp", "cp")},
    "ep": shared("ep", None, "MoE models; default 1; /api/best searches it unless given"),
    "zero": shared("zero", 0),
    "micro_batch": shared("micro_batch", 1),
    "recompute": shared("recompute", "none"),
    "schedule": shared("schedule", "1f1b", "pp > 1"),
    "virtual_stages": shared("virtual_stages", 1),
    "sp": shared("sp", True, "with tp"),
    "offload": shared("offload", "none"),
    "top": Spec("int", 8, 1, 20, help="how many of the best layouts to list"),
}


INT_TEXT = re.compile(r"[+-]?[0-9]{1,4000}")  # ASCII digits only: no 1_000, no other scripts' digits
FLOAT_TEXT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,6})?")


def _shown(raw: str) -> str:
    return raw if len(raw) <= 40 else f"{raw[:20]}...({len(raw)} characters)"


def _number(name: str, raw: str, spec: Spec) -> float:
    """The value of a numeric parameter, refused (never an overflow) when malformed or out of range."""
    lo, hi = (int(spec.lo), int(spec.hi)) if spec.kind == "int" else (spec.lo, spec.hi)
    limits = f"{lo} to {hi}" + "".join(f" or {a}" for a in spec.also)
    pattern = INT_TEXT if spec.kind == "int" else FLOAT_TEXT
    if not pattern.fullmatch(raw):
        what = "a whole number" if spec.kind == "int" else "a number"
        raise BadRequest(f"{name} must be {what} from {limits}, got {_shown(raw)!r}")
    value = int(raw) if spec.kind == "int" else float(raw)  # ints compare exactly, at any size
    if (spec.kind != "int" and not math.isfinite(value)) or not spec.span.holds(value):
        raise BadRequest(f"{name} = {_shown(raw)} is out of range: {limits}")
    return value


def parse_value(name: str, raw: str) -> Any:
    """One parameter's checked value (its type, range or words), before the checks between them."""
    spec = SPECS[name]
    if spec.kind == "choice":
        if raw not in spec.choices:
            hint = suggest(raw, spec.choices)
            hint = f"{hint}; " if hint.startswith("did you mean") else ""
            raise BadRequest(f"{name} = {raw!r} is not known; {hint}one of: {', '.join(spec.choices)}")
        return raw
    if spec.kind == "bool":
        if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise BadRequest(f"{name} must be true or false, got {raw!r}")
        return raw.lower() in ("true", "1", "on")
    return _number(name, raw, spec)


def parse(query: dict[str, list[str]]) -> dict[str, Any]:
    """Checked values of a parsed query string (``urllib.parse.parse_qs``), defaults filled."""
    values: dict[str, Any] = {}
    for name, raws in query.items():
        if name not in SPECS:
            hint = suggest(name, SPECS)
            raise BadRequest(
                f"unknown parameter {name!r}; "
                + (hint if hint.startswith("did you mean") else "known: " + ", ".join(SPECS))
            )
        if len(raws) != 1:
            raise BadRequest(f"parameter {name!r} is given {len(raws)} times; give it once")
        values[name] = parse_value(name, raws[0].strip())
    out = {k: s.default for k, s in SPECS.items()} | values
    if out["global_batch"] is None:
        out["global_batch"] = out["gpus"]
    if out["precision"] == "auto":  # as a run resolves it: fp32 on a CPU, bf16 on a GPU
        out["precision"] = "fp32" if out["gpu"] == "cpu" else "bf16"
    _cross_check(out, values)
    return out


def _cross_check(out: dict[str, Any], given: dict[str, Any]) -> None:
    """Checks between parameters that no single range expresses."""
    for k in ("tp", "pp", "cp", "ep"):
        if (out[k] or 1) > out["gpus"]:
            raise BadRequest(f"{k} = {out[k]} is more than gpus = {out['gpus']}")
    if out["micro_batch"] > out["global_batch"]:
        raise BadRequest(f"micro_batch = {out['micro_batch']} is more than global_batch = {out['global_batch']}")
    if out["model"] != "custom":
        extra = [k for k in SHAPE_KEYS if k in given]
        if extra:
            raise BadRequest(f"{', '.join(extra)}: shape fields need model=custom (model={out['model']} is a preset)")
    else:
        missing = [k for k in SHAPE_KEYS if out[k] is None and k not in ("kv_heads", "tie_embeddings")]
        if missing:
            raise BadRequest(f"model=custom needs {', '.join(missing)}")


def shape_of(v: dict[str, Any]) -> ModelShape:
    """The model: a preset, or the explicit shape (refused with the shape's own message)."""
    if v["model"] != "custom":
        return from_preset(v["model"])
    try:
        return check_flags(
            ModelShape(
                layers=v["layers"],
                hidden=v["hidden"],
                heads=v["heads"],
                kv_heads=v["kv_heads"] or v["heads"],
                ffn_hidden=v["ffn_hidden"],
                vocab_size=v["vocab"],
                tie_embeddings=v["tie_embeddings"],
                name="custom",
            )
        )
    except Exception as e:  # the planner's ConfigError names the field
        raise BadRequest(f"model shape: {e}") from None


def hardware_of(v: dict[str, Any]) -> Hardware:
    """The GPU preset with any explicit figures laid over it."""
    hw = get_hardware(v["gpu"])
    if v["precision"] not in hw.peak_flops and v["peak_tflops"] is None:
        raise BadRequest(f"{hw.name} has no {v['precision']} peak; pick {', '.join(hw.peak_flops)} or set peak_tflops")
    if v["offload"] == "cpu" and not can_offload(hw):
        raise BadRequest(f"offload = 'cpu' on gpu = {hw.name}: no host to offload to; offload = none or a GPU preset")
    if v["hbm_gib"] is not None:
        hw = replace(hw, hbm_gib=v["hbm_gib"])
    if v["peak_tflops"] is not None:
        hw = replace(hw, peak_flops={**hw.peak_flops, v["precision"]: v["peak_tflops"] * 1e12})
    if v["intra_bw_gbs"] is not None:
        hw = replace(hw, intra_bw=v["intra_bw_gbs"] * 1e9)
    if v["inter_bw_gbs"] is not None:
        hw = replace(hw, inter_bw=v["inter_bw_gbs"] * 1e9)
    return hw
