"""Flat-tensor collectives under the names the installed torch has: torch 2.13 renamed
``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and deprecates the old
names; older torch has only those. Looked up per call, because the communication counter
(comm_stats.py) swaps wrappers into the module attributes on measured steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``inp`` concatenated into ``out`` (world × inp elements)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """The sum over ranks of ``inp``, each rank keeping its 1/world slice in ``out``."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, group=group)
