"""Model and optimizer state as DCP sees it: keyed by parameter name, each rank holding
only its shards, so a checkpoint written under one layout loads under any other.

What is saved: ``{"model": {fqn: tensor}, "optim": {fqn: {"step", "exp_avg", "exp_avg_sq"}}}``.
Parameters and Adam moments are DTensors under FSDP/TP (DCP writes each rank's shards and
reads back whatever slices the loading layout needs) and plain tensors under DDP (written
once). Only tensors are saved: the optimizer's hyper-parameters come from the config and
its learning rate from the schedule, so there is nothing else to restore and nothing to
unpickle: loads read DCP's metadata through safe_metadata.py, never ``pickle.load``.

ZeRO-1 (``ZeroRedundancyOptimizer``) holds Adam state for the whole tensors it owns; those
entries use the same keys, written by their owner and read back by whichever rank owns
them in the loading layout.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

from meshforge.checkpoint.safe_metadata import read_metadata, safe_reader
from meshforge.checkpoint.validate import CheckpointError
from meshforge.compat import dcp_stager_reusable

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# A world of one saves and loads without a process group, which DCP announces every time --
# for a background save from its own writer thread, where a catch_warnings() block around
# the call cannot reach (and would not be thread-safe), so the filter is set once here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _is_zero1(optimizer: object) -> bool:
    """Whether ``optimizer`` is torch's ZeroRedundancyOptimizer, without importing it: a run that
    built one has imported its module already; the others never pay for the import."""
    mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return mod is not None and isinstance(optimizer, mod.ZeroRedundancyOptimizer)


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


def plain(state: Any) -> Any:
    """``state`` as plain dicts of tensors and numbers: a module's state dict is an
    ``OrderedDict`` carrying ``_metadata`` (module versions) that DCP does not save, and the
    background stager would deep-copy it with every save."""
    if isinstance(state, dict):
        return {k: plain(v) for k, v in state.items()}
    return state


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer tensors to save, by parameter name (plain data: see ``plain``)."""
    if hasattr(optimizer, "full_training_state"):  # bf16 ZeRO-1 (parallel/data/zero1.py): full fp32 tensors
        return plain(optimizer.full_training_state(model))
    msd = get_model_state_dict(model)
    if _is_zero1(optimizer):
        return plain({"model": msd, "optim": _zero1_state(model, optimizer, init=False)})
    return plain({"model": msd, "optim": get_optimizer_state_dict(model, optimizer)["state"]})


def save(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank writes its shards of ``state`` into ``path`` (a collective over ``group``)."""
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
    no_dist = group is None and not dist.is_initialized()
    dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)


def async_save(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> Future:
    """``save`` in the background through ``dcp.async_save``: returns once DCP has copied
    ``state`` to host memory (so training may change the original); the future completes
    when every rank's shards are written. ``group`` must be a gloo group (a CPU backend),
    never the training group: a background writer sharing it was seen to corrupt gloo
    traffic or hang."""
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)
    no_dist = group is None and not dist.is_initialized()
    stager = _stager()
    extra = {} if stager is None else {"async_stager": stager}
    return dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=no_dist, **extra)


_STAGER: list[Any] = []


def _stager() -> Any:
    """One DCP stager per process, so its host copies are allocated once and reused by every
    save: pinned (page-locked) on CUDA, where a pinned device-to-host copy runs at full PCIe
    speed and the training step waits only for that copy; plain memory on a CPU-only torch.
    None where the installed torch has no ``DefaultStager`` (DCP then copies per save). On a
    torch whose stager cannot be reused (2.11: see compat.py) a new one per save."""
    if _STAGER and not dcp_stager_reusable():
        _STAGER.clear()
    if not _STAGER:
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # torch < 2.9
            _STAGER.append(None)
            return None
        cuda = torch.cuda.is_available()
        opts = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
        )
        _STAGER.append(DefaultStager(opts))
    return _STAGER[0]


def staging_is_pinned() -> bool:
    """Whether background saves stage into pinned host memory (CUDA runs report it)."""
    s = _stager()
    return bool(s is not None and s._config.use_pinned_memory)


def _dcp_read(state_dict: dict[str, Any], storage_reader: dcp.FileSystemReader, **kw: Any) -> None:
    """DCP's load, its failure to read the shards as the metadata places them (bytes moved or
    swapped by someone who hashed them again: an unpickling or size error inside DCP) said as a
    CheckpointError naming the checkpoint, not DCP's traceback of every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state_dict, storage_reader=storage_reader, **kw)
    except CheckpointException as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        raise CheckpointError(
            f"checkpoint {storage_reader.path}: its shards do not read as its .metadata places them "
            f"({last[0].strip()[:200]}); the checkpoint is damaged or was edited; use another checkpoint"
        ) from None


def _reader(path: Path) -> dcp.FileSystemReader:
    """A reader over ``path`` whose metadata was checked first: DCP swallows a reader's error
    and retries with per-rank metadata, which would hide the reason behind its own."""
    read_metadata(Path(path) / ".metadata")
    return safe_reader(str(path))


def load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    group: dist.ProcessGroup | None = None,
    wrap: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    fill: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Load a checkpoint's model and optimizer state into this layout's shards (collective).
    ``wrap``: the tree the state was saved in (DiLoCo nests it per island, beside its own state);
    ``extra``: more entries of that tree (plain tensors), loaded in place; ``fill``: fills the tree
    in place instead of DCP reading ``path`` (a memory checkpoint: checkpoint/memory_tier.py)."""
    reader = _reader(path) if fill is None else None
    no_dist = not dist.is_initialized()
    read = _dcp_read if fill is None else (lambda sd, **kw: fill(sd))
    outer = wrap or (lambda sd: sd)
    wrap = lambda sd: outer({**sd, **(extra or {})})  # noqa: E731
    if hasattr(optimizer, "full_training_state"):
        full = optimizer.full_training_state(model, init=True)
        read(wrap(full), storage_reader=reader, process_group=group, no_dist=no_dist)
        optimizer.load_full_training_state(model, full)
        return
    msd = get_model_state_dict(model)
    if _is_zero1(optimizer):
        osd_state = _zero1_state(model, optimizer, init=True)
        sd = wrap({"model": msd, "optim": osd_state})
        read(sd, storage_reader=reader, process_group=group, no_dist=no_dist)
        set_model_state_dict(model, msd)
        return  # the state tensors were loaded in place into the local optimizer
    osd = get_optimizer_state_dict(model, optimizer)  # initialises empty Adam state to load into
    read(wrap({"model": msd, "optim": osd["state"]}), storage_reader=reader, process_group=group, no_dist=no_dist)
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optimizer, osd)


def load_model_only(model: nn.Module, path: Path) -> None:
    """Full weights from a checkpoint into an unsharded model in this one process (for export)."""
    msd = get_model_state_dict(model, options=StateDictOptions())
    _dcp_read({"model": msd}, storage_reader=_reader(path), no_dist=True)
    set_model_state_dict(model, msd)


def read_train_state(path: Path) -> dict[str, torch.Tensor] | None:
    """The train state the shards carry (step, tokens_seen, consumed: int64 scalars), read in
    this one process without a model (None: a checkpoint from before they were saved). Under
    DiLoCo every island saved its own copy; the first is read."""
    keys = read_metadata(Path(path) / ".metadata").state_dict_metadata
    found = sorted(k for k in keys if k == "train.step" or k.endswith(".train.step"))
    if not found:
        return None
    names, prefix = ("step", "tokens_seen", "consumed"), found[0].removesuffix("step")
    if any(prefix + n not in keys for n in names):
        return None
    tree: dict[str, Any] = {"train": {n: torch.zeros((), dtype=torch.int64) for n in names}}
    for part in reversed(found[0].split(".")[:-2]):  # islandN.train.step: nested under islandN
        tree = {part: tree}
    _dcp_read(tree, storage_reader=_reader(path), no_dist=True)
    while "train" not in tree:
        tree = next(iter(tree.values()))
    return tree["train"]
