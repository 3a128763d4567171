"""Model and optimizer state as DCP sees it: keyed by parameter name, each rank holding
only its shards, so a checkpoint written under one layout loads under any other.

What is saved: ``{"model": {fqn: tensor}, "optim": {fqn: {"step", "exp_avg", "exp_avg_sq"}}}``.
Parameters and Adam moments are DTensors under FSDP/TP (DCP writes each rank's shards and
reads back whatever slices the loading layout needs) and plain tensors under DDP (written
once). Only tensors are saved: the optimizer's hyper-parameters come from the config and
its learning rate from the schedule, so there is nothing else to restore and nothing to
unpickle.

ZeRO-1 (``ZeroRedundancyOptimizer``) holds Adam state for the whole tensors it owns; those
entries use the same keys, written by their owner and read back by whichever rank owns
them in the loading layout.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def _quiet(no_dist: bool) -> Iterator[None]:
    """A world of one saves and loads without a process group, which DCP announces every time."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fqns(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _zero1_state(model: nn.Module, zero: ZeroRedundancyOptimizer, init: bool) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's Adam state under ZeRO-1, by parameter name (``init``: zeros to load into)."""
    names = _fqns(model)
    local = zero.optim
    out = {}
    for group in local.param_groups:
        for p in group["params"]:
            st = local.state.get(p)
            if init or not st:
                st = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
                local.state[p] = st
            out[names[id(p)]] = st
    return out


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer tensors to save, by parameter name."""
    msd = get_model_state_dict(model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return {"model": msd, "optim": _zero1_state(model, optimizer, init=False)}
    return {"model": msd, "optim": get_optimizer_state_dict(model, optimizer)["state"]}


def stage(state: Any, pin: bool) -> Any:
    """A copy of ``state`` in host memory (pinned on CUDA), so training may change the
    original while a background thread writes the copy."""
    if isinstance(state, dict):
        return {k: stage(v, pin) for k, v in state.items()}
    if isinstance(state, DTensor):
        local = stage(state.to_local(), pin)
        return DTensor.from_local(
            local, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if isinstance(state, torch.Tensor):
        t = state.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out.copy_(t, non_blocking=True)
        return out
    return state


def save(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank writes its shards of ``state`` into ``path`` (a collective over ``group``)."""
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
    no_dist = group is None and not dist.is_initialized()
    with _quiet(no_dist):
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)


def load(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, group: dist.ProcessGroup | None = None
) -> None:
    """Load a checkpoint's model and optimizer state into this layout's shards (collective)."""
    reader = dcp.FileSystemReader(str(path))
    no_dist = not dist.is_initialized()
    msd = get_model_state_dict(model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        osd_state = _zero1_state(model, optimizer, init=True)
        with _quiet(no_dist):
            dcp.load({"model": msd, "optim": osd_state}, storage_reader=reader, process_group=group, no_dist=no_dist)
        set_model_state_dict(model, msd)
        return  # the state tensors were loaded in place into the local optimizer
    osd = get_optimizer_state_dict(model, optimizer)  # initialises empty Adam state to load into
    with _quiet(no_dist):
        dcp.load({"model": msd, "optim": osd["state"]}, storage_reader=reader, process_group=group, no_dist=no_dist)
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optimizer, osd)


def load_model_only(model: nn.Module, path: Path) -> None:
    """Full weights from a checkpoint into an unsharded model in this one process (for export)."""
    msd = get_model_state_dict(model, options=StateDictOptions())
    with _quiet(True):
        dcp.load({"model": msd}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    set_model_state_dict(model, msd)
