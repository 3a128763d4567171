"""Fault injection, to test that a run survives (or names) what clusters do to it.

``MESHFORGE_FAULT`` holds one fault, or several of different kinds separated by commas:

- ``kill:rank=R:step=S`` SIGKILLs rank R right after step S; ``kill:rank=R:save=S`` while
  the checkpoint of step S is being written (its shards on disk, the checkpoint incomplete);
- ``nan:rank=R:step=S`` turns rank R's forward output non-finite at step S: its loss, and
  through backward and the gradient reduction every rank's gradients (an overflow's path);
- ``spike:step=S`` multiplies step S's loss, as every rank sees and logs it, by 20;
- ``hang:rank=R:step=S`` makes rank R stop before step S's work and never come back;
- ``slow:rank=R:factor=F`` makes rank R's forward passes F times as slow (every step);
- ``pace:ms=M`` makes every rank sleep M ms after each step, on every attempt (a test whose
  run must outlast what it does to the run: hosts killed and started again);
- ``bitflip:rank=R:step=S`` flips one bit of one weight on rank R right after step S (silent data
  corruption: the first element of the first parameter shard it holds, a low mantissa bit).

Faults other than pace fire only on the first attempt (``launch_env.restart_count()`` = 0), so a restarted
group runs clean, and nan / spike only once (a step redone after a rollback runs clean).
Nothing happens when the variable is unset. ``attach`` puts them on a run's hooks (health/fault_hooks.py):
the loop, the checkpoint saver and the health guard never call a fault themselves.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshforge.errors import ConfigError
from meshforge.health.fault_hooks import RunHooks
from meshforge.health.sdc import INT_VIEW, local
from meshforge.launch import env as launch_env

# kind -> the fields it takes, in order
KINDS = {"kill": ("rank", "step|save"), "nan": ("rank", "step"), "spike": ("step",), "hang": ("rank", "step")}
KINDS["slow"] = ("rank", "factor")
KINDS["pace"] = ("ms",)
KINDS["bitflip"] = ("rank", "step")
SPIKE_FACTOR = 20.0
USAGE = (
    "expected one of kill:rank=R:step=S, kill:rank=R:save=S, nan:rank=R:step=S, spike:step=S, "
    "hang:rank=R:step=S, slow:rank=R:factor=F, pace:ms=M, bitflip:rank=R:step=S"
)


def parse(spec: str) -> tuple[str, dict[str, float]]:
    """``kind:key=value:...`` as (kind, {key: number}); refuses anything else, naming the forms."""
    kind, *parts = spec.split(":")
    if kind not in KINDS or len(parts) != len(KINDS[kind]):
        raise ConfigError(f"MESHFORGE_FAULT = {spec!r}: {USAGE}")
    fields: dict[str, float] = {}
    try:
        for part, allowed in zip(parts, KINDS[kind], strict=True):
            key, value = part.split("=")
            if key not in allowed.split("|"):
                raise ValueError
            fields[key] = float(value) if key == "factor" else int(value)
    except ValueError:
        raise ConfigError(f"MESHFORGE_FAULT = {spec!r}: {USAGE}") from None
    return kind, fields


def active(kind: str) -> dict[str, float] | None:
    """The fields of the configured fault of ``kind`` (on the first attempt only), else None."""
    spec = os.environ.get("MESHFORGE_FAULT", "")
    if not spec or launch_env.restart_count() > 0:
        return None
    for one in spec.split(","):
        got, fields = parse(one)
        if got == kind:
            return fields
    return None


def attach(hooks: RunHooks, rank: int, forward_modules: list[nn.Module]) -> None:
    """Put the configured faults (first attempt only; pace on every attempt) on a run's hooks;
    ``forward_modules``: the modules this rank's forward calls (the last one is poisoned by nan)."""
    for spec in filter(None, os.environ.get("MESHFORGE_FAULT", "").split(",")):
        parse(spec)  # a malformed spec is refused even on a restart
    pause = _pace_s(os.environ.get("MESHFORGE_FAULT", ""))
    if pause > 0:
        hooks.after_step.append(lambda _step: time.sleep(pause))
    for kind, fields in _mine(rank).items():
        at = int(fields.get("step", fields.get("save", 0)))
        if kind == "kill":
            (hooks.shards_written if "save" in fields else hooks.after_step).append(_at(at, _kill))
        elif kind == "hang":
            hooks.before_step.append(_at(at, _hang))
        elif kind == "nan" and forward_modules:
            hooks.before_step.append(_at(at, functools.partial(_poison, forward_modules[-1]), once="nan"))
        elif kind == "bitflip" and forward_modules:
            hooks.after_step.append(_at(at, functools.partial(flip_bit, forward_modules[0]), once="bitflip"))
        elif kind == "spike":
            hooks.loss.append(functools.partial(_spike, at))
        elif kind == "slow":
            for m in forward_modules:
                _slow_down(m, float(fields["factor"]))


def _mine(rank: int) -> dict[str, dict[str, float]]:
    """The active faults (first attempt) that concern ``rank`` (spike concerns every rank)."""
    out = {}
    for kind in ("kill", "hang", "nan", "spike", "slow", "bitflip"):
        f = active(kind)
        if f is not None and f.get("rank", rank) == rank:
            out[kind] = f
    return out


def _at(step: int, action: Callable[[], None], once: str = "") -> Callable[[int], None]:
    """A step hook that runs ``action`` at ``step`` (only the first time, for ``once``)."""

    def hook(n: int) -> None:
        if n == step and (not once or _once(once, True)):
            action()

    return hook


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _spike(at: int, step: int, loss: Any) -> Any:
    return loss * SPIKE_FACTOR if _once("spike", step == at) else loss


def _hang() -> None:
    """Never return (the hang watchdog ends the run)."""
    while True:
        time.sleep(3600)


def _poison(module: nn.Module) -> None:
    """The module's next output times NaN: its loss and, through backward and the gradient
    reduction, every rank's gradients turn non-finite, as a real overflow does."""

    def poison(_module: nn.Module, _args: Any, out: Any) -> Any:
        handle.remove()
        return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")

    handle = module.register_forward_hook(poison)


FLIPPED_BIT = {1: 1, 2: 4, 4: 13, 8: 42}  # element size -> a low mantissa bit (bf16/fp16, fp32, fp64)


@torch.no_grad()
def flip_bit(module: nn.Module) -> str | None:
    """Flip one low mantissa bit of the first element of ``module``'s first parameter shard this
    rank holds; returns the parameter's name (None: it holds none)."""
    for name, p in module.named_parameters():
        shard = local(p)
        if shard.numel():
            bits = shard.view(-1)[:1].view(INT_VIEW[shard.element_size()])
            bits ^= 1 << FLIPPED_BIT[shard.element_size()]
            return name
    return None


def _slow_down(module: nn.Module, factor: float) -> None:
    """Each forward of ``module`` lasts ``factor`` times as long. The sleep runs inside the
    forward's timing hooks (registered earlier by the health keeper), so it counts as compute."""
    start = [0.0]
    module.register_forward_pre_hook(lambda *_: start.__setitem__(0, time.perf_counter()))
    module.register_forward_hook(lambda *_: time.sleep((time.perf_counter() - start[0]) * (factor - 1)), prepend=True)


_fired: set[str] = set()  # a step redone after a rollback runs clean


def _once(kind: str, hit: bool) -> bool:
    if not hit or kind in _fired:
        return False
    _fired.add(kind)
    return True


@functools.cache
def _pace_s(spec: str) -> float:
    for one in spec.split(","):
        if one.startswith("pace:"):
            return parse(one)[1]["ms"] / 1000
    return 0.0
