"""DiLoCo and Streaming DiLoCo: islands of ranks that train apart and meet every few steps.

DiLoCo (Douillard et al. 2023): each of M islands runs the configured inner layout (DDP,
FSDP, TP, PP, ...) with its own AdamW for H steps; then the islands average their
pseudo-gradients (the round's start weights minus the current ones) and an outer SGD with
Nesterov momentum moves the shared *outer* weights, which every island continues from.
Only this sync crosses islands, over the ``island`` mesh dimension (the outermost: see
parallel/rules.py); each rank averages its own local shard with the ranks at the same inner
coordinates in the other islands, so under FSDP/TP the outer state is per local shard.

Streaming DiLoCo (Douillard et al. 2025): the parameters are split into ``fragments``
(contiguous groups of blocks; the embedding joins the first, the final norm and head the
last), synced H / F steps apart. Fragment f is sent after inner step ``(f+1)·H/F - delay``
of a round (an asynchronous collective, overlapped with the next ``delay`` inner steps) and
applied after step ``(f+1)·H/F``: its outer weights step and its parameters take them
(the inner progress of the ``delay`` overlapped steps on that fragment is dropped, i.e. the
paper's mixing factor 0, as torchft's default). Pseudo-gradients travel in ``sync_dtype``:
fp32 or bf16 (an all-reduce), or fp8 e4m3 with per-block scales and error feedback (an
all-gather of the bytes, summed in fp32 in island order), so peak bytes per sync fall by
the fragment count and again by the dtype.

The round position is the step count itself (``after_step(step)``); a checkpoint holds
the outer weights, the momentum, fp8's error feedback and the averaged result of a
fragment still in flight (waited for at the save), per island (see ``wrap_state``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

OUTER_DTYPE = torch.float64  # pseudo-gradients are differences of nearby weights: exact in fp64 (see docs)
FP8_BLOCK = 256  # values per fp8 scale
FP8_MAX = 448.0  # largest float8_e4m3fn value


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (the tensor itself when it is not a DTensor), sharing storage."""
    if isinstance(p, DTensor):
        with torch.no_grad():  # without autograd, to_local is the local tensor itself
            return p.to_local()
    return p


def fragment_of(name: str, layers: int, fragments: int) -> int:
    """The fragment a parameter belongs to: block i goes to i·F // L; other parameters to the
    first (embedding) or last (final norm, head) fragment."""
    m = re.match(r"(?:.*\.)?layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) * fragments // layers
    return 0 if "embed" in name else fragments - 1


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 values and one fp32 scale per block of FP8_BLOCK, as one byte buffer, and the dequantized x."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, -n % FP8_BLOCK)).view(-1, FP8_BLOCK)
    scale = padded.abs().amax(dim=1).clamp_min(1e-30) / FP8_MAX
    q = (padded / scale[:, None]).to(torch.float8_e4m3fn)
    wire = torch.cat([scale.view(torch.uint8), q.view(torch.uint8).flatten()])
    return wire, fp8_decode(wire, n)


def fp8_decode(wire: torch.Tensor, n: int) -> torch.Tensor:
    blocks = -(-n // FP8_BLOCK)
    scale = wire[: 4 * blocks].view(torch.float32)
    q = wire[4 * blocks :].view(torch.float8_e4m3fn).view(blocks, FP8_BLOCK)
    return (q.float() * scale[:, None]).flatten()[:n]


@dataclass
class Fragment:
    index: int
    params: list[torch.Tensor]  # the model's parameters (DTensor or plain)
    outer: list[torch.Tensor]  # their outer weights, local shards in OUTER_DTYPE
    send_at: int  # round position (1..H) after which its pseudo-gradient is sent
    apply_at: int  # ... and after which the average is applied
    error: torch.Tensor | None = None  # fp8 error feedback (flat, OUTER_DTYPE)
    work: Any = None  # the collective in flight
    wire: Any = None  # its buffer(s)
    result: torch.Tensor | None = None  # the averaged pseudo-gradient (flat, OUTER_DTYPE) once known
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(o.numel() for o in self.outer)


class DiLoCo:
    """One rank's DiLoCo state; ``after_step(step)`` after every inner optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None,
        islands: int,
        island: int,
        inner_steps: int,
        layers: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        delay: int = 0,
        sync_dtype: str = "fp32",
        warmup: int = 0,
    ):
        self.group, self.islands, self.island, self.warmup = group, islands, island, warmup
        self.h, self.delay, self.sync_dtype = inner_steps, delay, sync_dtype
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.outer = [local(p).detach().to(OUTER_DTYPE, copy=True) for _, p in named]
        self.outer_opt = torch.optim.SGD(
            self.outer, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )
        if outer_momentum > 0:  # a zero buffer steps exactly as SGD's first-step copy, and is checkpointable
            for o in self.outer:
                self.outer_opt.state[o]["momentum_buffer"] = torch.zeros_like(o)
        every = inner_steps // fragments
        self.fragments = []
        for f in range(fragments):
            mine = [i for i, n in enumerate(self.names) if fragment_of(n, layers, fragments) == f]
            params, outer = [named[i][1] for i in mine], [self.outer[i] for i in mine]
            frag = Fragment(f, params, outer, (f + 1) * every - delay, (f + 1) * every)
            if sync_dtype == "fp8":
                frag.error = torch.zeros(frag.numel, dtype=OUTER_DTYPE, device=self.outer[0].device)
            self.fragments.append(frag)

    # -- the schedule ---------------------------------------------------------------------

    def in_warmup(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is one of the warm-up's data-parallel steps."""
        return step <= self.warmup

    @torch.no_grad()
    def average_grads(self) -> None:
        """Warm-up: average the gradients over the islands before the update (DDP over all of them)."""
        for p in self.params:
            if p.grad is not None:
                g = local(p.grad)
                dist.all_reduce(g, group=self.group)
                g.div_(self.islands)

    def after_step(self, step: int) -> None:
        """Send and apply the fragments due after inner step ``step`` (1-based, counted over the run);
        the last warm-up step makes the (equal) weights the outer weights, and rounds start after it."""
        if step <= self.warmup:
            if step == self.warmup:
                with torch.no_grad():
                    for o, p in zip(self.outer, self.params, strict=True):
                        o.copy_(local(p))
            return
        pos = (step - self.warmup - 1) % self.h + 1
        for frag in self.fragments:
            if pos == frag.send_at:
                self._send(frag)
            if pos == frag.apply_at:
                self._apply(frag)

    def _send(self, frag: Fragment) -> None:
        if not frag.outer:
            return
        pg = torch.cat([(o - local(p).to(OUTER_DTYPE)).flatten() for o, p in zip(frag.outer, frag.params, strict=True)])
        frag.work, frag.result = None, None
        if self.group is None or self.islands == 1:  # no wire: the exact pseudo-gradient
            frag.wire = pg
            return
        if self.sync_dtype == "fp8":
            pg = pg + frag.error
            wire, sent = fp8_encode(pg.float())
            frag.error = pg - sent.to(OUTER_DTYPE)
        else:
            wire = pg.float().to(torch.bfloat16) if self.sync_dtype == "bf16" else pg.float()
        if self.sync_dtype == "fp8":
            frag.wire = [torch.empty_like(wire) for _ in range(self.islands)]
            frag.work = dist.all_gather(frag.wire, wire, group=self.group, async_op=True)
        else:
            frag.wire = wire
            frag.work = dist.all_reduce(wire, group=self.group, async_op=True)

    def _finish(self, frag: Fragment) -> None:
        """Wait for the fragment's collective and keep the averaged pseudo-gradient."""
        if frag.work is not None:
            frag.work.wait()
            frag.work = None
        if frag.wire is None:
            return
        if isinstance(frag.wire, list):  # fp8: summed in island order, the same on every island
            total = torch.zeros(frag.numel, dtype=OUTER_DTYPE, device=frag.outer[0].device)
            for w in frag.wire:
                total += fp8_decode(w, frag.numel).to(OUTER_DTYPE)
        else:
            total = frag.wire.to(OUTER_DTYPE)
        frag.result, frag.wire = total / self.islands, None

    @torch.no_grad()
    def _apply(self, frag: Fragment) -> None:
        if not frag.outer:
            return
        self._finish(frag)
        offset = 0
        for o in frag.outer:
            o.grad = frag.result[offset : offset + o.numel()].view_as(o)
            offset += o.numel()
        self.outer_opt.step()  # SGD skips the other fragments' weights (grad None)
        for o, p in zip(frag.outer, frag.params, strict=True):
            o.grad = None
            local(p).copy_(o)
        frag.result = None

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Outer weights, momentum, fp8 error feedback and in-flight averages (waited for here)."""
        out: dict[str, Any] = {"outer": dict(zip(self.names, self.outer, strict=True))}
        if self.outer_opt.defaults["momentum"] > 0:
            bufs = [self.outer_opt.state[o]["momentum_buffer"] for o in self.outer]
            out["momentum"] = dict(zip(self.names, bufs, strict=True))
        for frag in self.fragments:
            if not frag.outer:
                continue
            out[f"fragment{frag.index}"] = {"pending": frag.result}
            if frag.error is not None:
                out[f"fragment{frag.index}"]["error"] = frag.error
        return out

    def settle(self) -> None:
        """After a save or a load: a pending average of NaNs means none was in flight."""
        for frag in self.fragments:
            if frag.result is not None and torch.isnan(frag.result).any():
                frag.result = None

    def wrap_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's tree (call ``settle`` after the save or load): under islands > 1
        each island's model, inner optimizer and DiLoCo state under its own key (islands
        diverge within a round; the same keys on every island would be deduplicated by DCP),
        else the plain tree plus ``diloco``."""
        self._prepare_pending()
        mine = {**state, "diloco": self.state_dict()}
        return {f"island{self.island}": mine} if self.islands > 1 else mine

    def _prepare_pending(self) -> None:
        """Give every fragment a result tensor to load into (or save): its average or NaNs."""
        for frag in self.fragments:
            if frag.outer:
                self._finish(frag)
                if frag.result is None:
                    frag.result = torch.full_like(frag.outer[0].new_empty(frag.numel), float("nan"))


def build_diloco(
    d: Any, islands: int, layers: int, mesh: Any, model: nn.Module, optimizer: torch.optim.Optimizer
) -> DiLoCo | None:
    """The run's DiLoCo (None when diloco.islands = 1), over the mesh's island dimension; ``d``
    is the [diloco] section, ``layers`` the model's blocks (fragments split them)."""
    if islands == 1:
        return None
    if hasattr(optimizer, "full_training_state"):
        from meshforge.errors import ConfigError

        raise ConfigError(
            "diloco.islands > 1 with bf16 ZeRO-1 (its fp32 master weights live in the optimizer, not the model); "
            "use parallel.zero_stage = 0, 2 or 3 under DiLoCo"
        )
    return DiLoCo(
        model,
        mesh.group("island"),
        islands,
        mesh.coordinate("island"),
        d.inner_steps,
        layers,
        d.outer_lr,
        d.outer_momentum,
        d.nesterov,
        d.fragments,
        d.delay,
        d.sync_dtype,
        d.warmup_steps,
    )
