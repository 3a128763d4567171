"""``meshforge plan``'s command line. A flag that sets a config key (``candidates.KEY_FLAGS``) is
built from that key's field: its help is the field's docstring, its range the field's ``ranged``
metadata, its words the field's ``Literal`` type, so `plan` accepts and refuses exactly what a
train config does (tests/unit/test_one_vocabulary.py walks every shared key). The planner's own flags
(the cluster, the hardware, what the search prices, the output) keep their help and bounds here.
A typo is refused with the flag's name and range before any search runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from meshforge.config.keys import keys, plain_text
from meshforge.planner import diloco_costs
from meshforge.planner.candidates import KEY_FLAGS
from meshforge.planner.estimate import SCHEDULES, V_SCHEDULES
from meshforge.planner.hardware import ATTENTION_KERNELS, PRESETS
from meshforge.ranges import Span


def whole(lo: int = 1, hi: int | None = None, *also: int) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number in lo..hi (or one of ``also``), refused with the range
    (argparse names the flag)."""

    def check(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {raw!r}") from None
        if v not in also and (v < lo or (hi is not None and v > hi)):
            if lo == 1:
                want = "a positive integer" + (f" up to {hi:,}" if hi is not None else "")
            else:
                want = f"an integer in {lo}..{hi:,}" if hi is not None else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"must be {want}{''.join(f' or {a}' for a in also)}, got {v}")
        return v

    return check


def real(
    lo: float = 0.0, hi: float | None = None, lo_open: bool = True, hi_open: bool = False
) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number above lo (or from lo, lo_open=False) and up to hi
    (or below it, hi_open)."""

    def check(raw: str) -> float:
        try:
            v = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {raw!r}") from None
        low_bad = v <= lo if lo_open else v < lo
        high_bad = hi is not None and (v >= hi if hi_open else v > hi)
        if not math.isfinite(v) or low_bad or high_bad:
            if hi is None:
                want = f"{'>' if lo_open else '>='} {lo:g}"
            elif lo_open or hi_open:
                want = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            else:
                want = f"in {lo:g}..{hi:g}"
            raise argparse.ArgumentTypeError(f"must be a number {want}, got {raw}")
        return v

    return check


def bounded(span: Span, kind: type) -> Callable[[str], Any]:
    """The argparse ``type=`` for a config key's range: the same values the loader accepts."""
    if kind is int:
        lo, hi = int(span.lo) + span.lo_open, int(span.hi) - span.hi_open
        return whole(lo, hi, *(int(a) for a in span.also))
    return real(span.lo, span.hi, lo_open=span.lo_open, hi_open=span.hi_open)


def sizes(each: Span, most: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type=``: comma-separated whole numbers, each in ``each`` (blocks per pipeline
    chunk, as parallel.pp_layers), at most ``most`` of them and in all."""

    def check(raw: str) -> tuple[int, ...]:
        try:
            out = tuple(int(x) for x in raw.split(","))
        except ValueError:
            want = "comma-separated whole numbers, e.g. 0,8,8,0"
            raise argparse.ArgumentTypeError(f"must be {want}; got {raw!r}") from None
        if not all(each.holds(x) for x in out):
            raise argparse.ArgumentTypeError(f"must be whole numbers, each in {each.text()}, got {raw!r}")
        if len(out) > most or sum(out) > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:,} blocks in all, got {raw!r}")
        return out

    return check


# upper bounds of the planner's own counts: far above any published run, low enough that a typo
# (an extra digit or ten) is refused by name instead of searching for minutes
MAX_GPUS = 2**20
MAX_TOKENS = 2**24  # --max-positions, --mean-doc-len

# words a flag takes beside its key's: "auto" leaves the offload to the search
SEARCHED_WORDS = {"parallel.offload": ("auto",)}
# the choices of a key the config types as a plain string (the layout rules judge its words)
OWN_CHOICES = {"parallel.pp_schedule": SCHEDULES + V_SCHEDULES}
SHAPE_KEYS = ("model.layers", "model.hidden", "model.heads", "model.kv_heads", "model.ffn_hidden", "model.vocab_size")
SHAPE_FLAGS = (*(KEY_FLAGS[k] for k in SHAPE_KEYS), "--max-positions")  # an explicit shape
MOE_KEYS = ("model.num_experts", "model.experts_per_token", "model.moe_ffn_hidden", "model.num_shared_experts")
MOE_KEYS += ("model.capacity_factor",)
FIXED_KEYS = ("parallel.tp", "parallel.pp", "parallel.dp_shard", "parallel.cp", "train.micro_batch_size")
FIXED_KEYS += ("parallel.pp_virtual_stages", "parallel.zero_stage", "parallel.ep", "train.activation_checkpoint")
FIXED_KEYS += ("parallel.pp_schedule", "parallel.offload")


def dest(dotted: str) -> str:
    """The attribute of the parsed arguments that holds config key ``dotted``'s flag."""
    return KEY_FLAGS[dotted].lstrip("-").replace("-", "_")


def attr(dotted: str) -> str:
    """The field (of Layout or ModelShape) that holds config key ``dotted``."""
    return keys()[dotted].attr


def choices(dotted: str) -> tuple[Any, ...]:
    """The words ``meshforge plan`` takes for a key: the planner's own list or the field's, and
    the words that leave it to the search."""
    return (*SEARCHED_WORDS.get(dotted, ()), *(OWN_CHOICES.get(dotted) or keys()[dotted].choices))


def key_flag(group: Any, dotted: str, note: str = "", **kw: Any) -> None:
    """Add the flag of config key ``dotted``: help, range or words from its field, ``note`` the
    planner's own word on it (a default, "searched when left out")."""
    k = keys()[dotted]
    where = f"{dotted}, {k.range_text()}" if k.range_text() else dotted
    kw["help"] = f"{plain_text(k.help)} ({where}{'; ' + note if note else ''})".replace("%", "%%")
    if k.type is bool:
        kw.setdefault("action", "store_true")
    elif choices(dotted):
        kw["choices"] = list(choices(dotted))
    elif k.each is not None:
        kw.update(type=sizes(k.each, int(keys()["model.layers"].span.hi)), metavar="N,N,...")
    elif k.span is not None:
        kw.update(type=bounded(k.span, k.type), metavar=kw.get("metavar", "N" if k.type is int else "X"))
    group.add_argument(KEY_FLAGS[dotted], **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a preset, explicit shape, or --config)")
    m.add_argument("--model", help="preset name, e.g. llama3.1-405b")
    m.add_argument("--config", help="a meshforge train config (e.g. a run's config.toml): model, batch, degrees")
    for dotted in SHAPE_KEYS:
        key_flag(m, dotted, "explicit shape")
    m.add_argument(
        "--max-positions",
        type=whole(1, MAX_TOKENS),
        metavar="N",
        help="position table size for learned positions (default: none, rotary)",
    )
    m.add_argument("--mlp", choices=["swiglu", "gelu"], default="swiglu", help="MLP kind (default swiglu)")
    key_flag(m, "model.tie_embeddings", "explicit shape")
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
        "on Hopper cuDNN as torch picks it, on Ampere FlashAttention-2; fa2-h100 for runs on flash-attn 2, "
        "triton-h100/triton-a100 for the 2022 Triton FlashAttention)",
    )
    for dotted in MOE_KEYS:  # with --model or --config they replace the preset's (docs/moe.md)
        key_flag(m, dotted, "mixture of experts; replaces the preset's")
    _add_training_arguments(p)
    _add_cluster_arguments(p)
    _add_fixed_arguments(p)
    diloco_costs.add_arguments(p, key_flag, real)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=whole(), default=10, metavar="N", help="rows of the ranking to show (default 10)")
    o.add_argument("--json", action="store_true", help="print the ranking as JSON instead of a table")
    o.add_argument("--emit-config", metavar="FILE", help="write a meshforge train config for the best runnable layout")


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training")
    key_flag(t, "train.seq_len", "default: the --config's, else 4096")
    key_flag(t, "train.global_batch_size", "default: the --config's, else one per GPU, i.e. --gpus")
    key_flag(t, "train.precision", "default: the --config's, else auto")
    t.add_argument(
        "--mean-doc-len",
        type=real(0.0, MAX_TOKENS),
        metavar="N",
        help="packed documents of this mean length (tokens), attention masked at their boundaries "
        "(data.document_mask): attention priced as it runs (default: none, causal over the sequence)",
    )
    c = t.add_mutually_exclusive_group()  # (the compile flags: see estimate's eager terms)
    note = "the default; --config takes the file's"
    key_flag(c, "train.compile", note, dest="eager", action="store_const", const=False)
    c.add_argument(
        "--eager",
        dest="eager",
        action="store_const",
        const=True,
        help="the run is not compiled (train.compile = false): element-wise chains and the loss run op by op",
    )
    key_flag(t, "train.mixed_precision", "--config takes the file's")


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


FIXED_NOTES = {
    "parallel.ep": "searched over the divisors of --experts when left out",
    "parallel.offload": "auto (default): searched only when nothing runnable fits without it",
    "parallel.pp_schedule": "with --pp > 1; searched when left out",
}


def _add_fixed_arguments(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fixed choices (the rest is searched)")
    for dotted in FIXED_KEYS:
        degree = -1 in (keys()[dotted].span.also if keys()[dotted].span else ())
        key_flag(f, dotted, FIXED_NOTES.get(dotted, "searched when left out" + (", as is -1" if degree else "")))
    key_flag(f, "parallel.pp_layers", "default: balanced")
    key_flag(f, "parallel.async_tp", "priced: hidden as far as each chunked GEMM lasts")
    key_flag(f, "parallel.sequence_parallel", "this flag sets it false")
