"""fp8 matmuls through torchao's float8 training, on a chosen set of linear layers.

``train.precision = "fp8"`` is a bf16 run (autocast, or FSDP2's bf16 parameters, over fp32
master weights) whose selected ``nn.Linear`` layers become torchao ``Float8Linear``: their
input, weight and output gradient are cast to fp8 with dynamic scales (``tensorwise``: one
scale per tensor; ``rowwise``: one per row, more accurate, torchao's "rowwise" recipe) and
multiplied in fp8; norms, residual adds, softmax and the loss stay in bf16/fp32.

Which linears: every one except those matching a ``train.fp8_exclude`` pattern (fnmatch on
the module name, or on a parent's name) and those with a dimension that is not a multiple
of 16 (fp8 matmul kernels need it). The decision is ``fp8_plan``, computed on the meta
model before launch (a boundary that leaves nothing in fp8 is refused there) and logged as
the ``fp8_modules`` event. torchao is imported only here and only for fp8 runs.

Devices: CUDA with compute capability >= 8.9 runs real fp8 matmuls (and, with FSDP2 and the
tensorwise recipe, all-gathers the weights in fp8); elsewhere torchao emulates them: the
same numerics, no speed-up.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Any

import torch
from torch import nn

from meshforge.errors import ConfigError
from meshforge.models.llama import ModelShape, build_model

FP8_DIM_MULTIPLE = 16
TORCHAO_PIN = "0.18.0"
INSTALL_HINT = f"pip install 'meshforge[fp8]' (or: pip install --no-deps torchao=={TORCHAO_PIN})"


@dataclasses.dataclass
class Fp8Plan:
    converted: list[str]
    excluded: dict[str, str]  # module name -> why it stays in bf16
    unmatched: list[str]  # fp8_exclude patterns that match no module

    def as_event(self) -> dict[str, Any]:
        return {"converted": self.converted, "excluded": self.excluded, "unmatched_patterns": self.unmatched}


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def fp8_plan(model: nn.Module, exclude: list[str]) -> Fp8Plan:
    """Which linear layers of ``model`` run in fp8, which do not and why."""
    names = [n for n, _ in model.named_modules() if n]
    converted, excluded = [], {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        hit = next((p for p in exclude if _matches(name, p)), None)
        if hit is not None:
            excluded[name] = f"train.fp8_exclude pattern {hit!r}"
        elif mod.in_features % FP8_DIM_MULTIPLE or mod.out_features % FP8_DIM_MULTIPLE:
            excluded[name] = f"dimensions {mod.in_features} x {mod.out_features} not multiples of {FP8_DIM_MULTIPLE}"
        else:
            converted.append(name)
    unmatched = [p for p in exclude if not any(_matches(n, p) for n in names)]
    return Fp8Plan(converted, excluded, unmatched)


def check_fp8_plan(plan: Fp8Plan) -> None:
    """Refuse a boundary that leaves no linear layer in fp8 (before launch)."""
    if not plan.converted:
        why = "; ".join(f"{k}: {v}" for k, v in list(plan.excluded.items())[:4])
        raise ConfigError(
            "train.fp8_exclude leaves no linear layer in fp8 "
            f"({why}{' ...' if len(plan.excluded) > 4 else ''}); narrow train.fp8_exclude "
            '(default: ["output", "*router*"]) or use train.precision = \'bf16\''
        )


def require_torchao() -> Any:
    """torchao.float8, or a ConfigError that says how to install it."""
    # its import logs a warning per CUDA kernel library it cannot load (all of them on a CPU build)
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8  # optional dependency: the `fp8` extra
    except ImportError:
        raise ConfigError(f"train.precision = 'fp8' needs torchao, which is not installed: {INSTALL_HINT}") from None
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return float8


def fp8_emulated(device: torch.device) -> bool:
    """No fp8 tensor cores here (CPU, or CUDA below compute capability 8.9): torchao emulates."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def fp8_all_gather(recipe: str, device: torch.device, gathers: bool) -> bool:
    """Whether FSDP2 all-gathers the weights in fp8: tensorwise on real fp8, and only where FSDP
    gathers over more than one rank (``dims.gathers_weights``). On a one-rank shard group (a
    world of one) there is nothing to gather, and the fp8 pre-all-gather cast would run per
    weight, eagerly, outside the compiled blocks: the GPU suite's 1B fp8 row was 43% busy so.
    (gloo has no fp8 collectives either: emulated runs never gather in fp8.)"""
    return recipe == "tensorwise" and gathers and not fp8_emulated(device)


def fp8_config(recipe: str, device: torch.device, gathers: bool) -> Any:
    """torchao's Float8LinearConfig for ``recipe`` (see fp8_all_gather for the all-gather)."""
    float8 = require_torchao()
    emulate = fp8_emulated(device)
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=fp8_all_gather(recipe, device, gathers), emulate=emulate
        )
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def apply_fp8(model: nn.Module, recipe: str, exclude: list[str], device: torch.device, gathers: bool) -> Fp8Plan:
    """Swap the planned linear layers of ``model`` (meta or real) for torchao Float8Linear, in
    place; ``gathers``: FSDP2 will all-gather its weights over more than one rank."""
    plan = fp8_plan(model, exclude)
    chosen = set(plan.converted)
    float8 = require_torchao()
    float8.convert_to_float8_training(
        model, config=fp8_config(recipe, device, gathers), module_filter_fn=lambda _mod, fqn: fqn in chosen
    )
    return plan


def precompute_fp8_scales(model: nn.Module) -> None:
    """After the optimizer step, under fp8 all-gather: every fp8 weight's scale in one fused
    amax and one all-reduce (torchao's recommendation), instead of one amax and one
    all-reduce per weight inside each pre-all-gather hook."""
    require_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


DEFAULT_EXCLUDE = ("output", "*router*")  # train.fp8_exclude's default; these may match nothing silently


def model_fp8_plan(args: ModelShape, exclude: list[str]) -> Fp8Plan:
    """The plan for the whole model of ``args`` (built on the meta device: no memory), checked:
    torchao must import and at least one linear must be left in fp8. Used before launch and
    for the ``fp8_modules`` event."""
    require_torchao()
    plan = fp8_plan(build_model(args, device="meta"), exclude)
    check_fp8_plan(plan)
    return plan


def unmatched_warnings(plan: Fp8Plan) -> list[str]:
    """A line per user-given exclude pattern that matches no module (a warning, not an error)."""
    return [
        f"train.fp8_exclude pattern {p!r} matches no module; it has no effect (module names look like "
        "'layers.0.attention.wq', 'layers.*.feed_forward.*', 'output')"
        for p in plan.unmatched
        if p not in DEFAULT_EXCLUDE
    ]
