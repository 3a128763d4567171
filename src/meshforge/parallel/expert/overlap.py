"""Expert parallelism with its all-to-alls overlapped: a micro-batch's tokens go out in chunks,
and one chunk's dispatch or combine travels while another chunk's experts compute (the way
DeepSeek-V3 overlaps two micro-batches' communication with computation, inside one MoE layer).

Chunk j of a rank's tokens is the j-th of ``chunks`` equal shares of every expert's rows (the
split parallel/tensor/moe.py's ``share_rows`` makes), so every rank knows every chunk's splits from
the one all-gather of per-expert counts the dispatch already makes. Forward, one transfer on the
wire at a time, in this order::

    dispatch 0 | dispatch 1 (beside experts 0) | combine 0 (beside experts 1) | ... | combine C-1

so of the 2C transfers only the first dispatch and the last combine wait; backward runs the
mirror image (each transfer's reverse), because every all-to-all is two autograd nodes: one
that starts it and one that waits for it (torch's functional collectives split them the same
way), and the autograd engine runs the later-created nodes first.

The experts run inside one FSDP forward call around the whole pipeline (``register``), so their
weights are gathered once and their gradients reduced once, whatever the number of chunks.
Rows are the same rows, so outputs and token gradients equal the one-chunk path's; the expert
weight gradients sum their chunks' GEMMs in another order (within 1e-6 in fp32).
"""

from __future__ import annotations

import collections
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import register_fsdp_forward_method

from meshforge.parallel import comm_stats


class _Transfer:
    """One variable-split all-to-all: ``inp`` rows out (``send[d]`` to rank d), ``out`` rows in."""

    def __init__(self, link: Link, inp: Tensor, send: list[int], recv: list[int]):
        self.link, self.inp, self.send, self.recv = link, inp.contiguous(), send, recv
        self.out = inp.new_empty((sum(recv), *inp.shape[1:]))
        self.work: Any = None
        self.back: _Transfer | None = None  # its reverse, started in backward

    def launch(self) -> None:
        group = self.link.group
        self.work = dist.all_to_all_single(self.out, self.inp, self.recv, self.send, group=group, async_op=True)


class Link:
    """The transfers of one MoE layer call, one on the wire at a time, in the order submitted:
    concurrent all-to-alls would share the link and delay the one the experts wait for."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.queue: collections.deque[_Transfer] = collections.deque()
        self.busy: _Transfer | None = None

    def submit(self, t: _Transfer) -> None:
        self.queue.append(t)
        self._next()

    def _next(self) -> None:
        if self.busy is None and self.queue:
            self.busy = self.queue.popleft()
            self.busy.launch()

    def wait(self, t: _Transfer) -> Tensor:
        while t.work is None:  # queued behind others: finish them first
            self.wait(self.busy)
        if self.busy is t:
            comm_stats.wait(t.work, self.group)
            self.busy = None
            self._next()
        return t.out


class _Start(torch.autograd.Function):
    """Starts an all-to-all; returns its (still arriving) output. Backward: waits for the reverse."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, t: _Transfer) -> Tensor:
        ctx.t = t
        t.link.submit(t)
        return t.out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        back = ctx.t.back
        return back.link.wait(back), None


class _Finish(torch.autograd.Function):
    """Waits for an all-to-all. Backward: starts the reverse transfer of the gradient."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, t: _Transfer) -> Tensor:
        ctx.t = t
        t.link.wait(t)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        t = ctx.t
        t.back = _Transfer(t.link, g, t.recv, t.send)
        t.link.submit(t.back)
        return g, None  # _Start.backward waits for the reverse transfer and hands that on


def start(link: Link, x: Tensor, send: list[int], recv: list[int]) -> tuple[Tensor, _Transfer]:
    t = _Transfer(link, x, send, recv)
    return _Start.apply(x, t), t


def finish(out: Tensor, t: _Transfer) -> Tensor:
    return _Finish.apply(out, t)


def run_experts(experts: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
    """The experts' own forward on one chunk, without their module hooks (inside ``register``'s
    FSDP call the weights are already gathered; a module call would gather and free them per chunk)."""
    return type(experts).forward(experts, x, counts)


def _through(experts: nn.Module, fn: Any, *args: Any) -> Any:
    return fn(*args)


def register(experts: nn.Module) -> None:
    """Give ``experts`` a ``dispatched(fn, *args)`` method that FSDP treats as a forward: the
    weights gathered once around the chunked pipeline ``fn``, gradients reduced once after it."""
    experts.dispatched = types.MethodType(_through, experts)
    register_fsdp_forward_method(experts, "dispatched")


def chunk_table(table: Tensor, j: int, chunks: int) -> Tensor:
    """Chunk ``j``'s share of every count (``share_rows``'s split: c·j//C up to c·(j+1)//C)."""
    return table * (j + 1) // chunks - table * j // chunks
