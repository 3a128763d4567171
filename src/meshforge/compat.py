"""Differences between the torch versions meshforge supports (2.11 to 2.13), in one place.

Every place where the installed torch's behaviour or private API differs goes through a
function here, so the rest of the code is written once against the newest torch and the
list of what an older one needs stays short and reviewable. Each entry says which torch
needs it; when the floor (pyproject.toml) passes that version, the entry goes.

- ``pipeline_stage_fixups``: torch 2.11's multi-stage schedules open every stage's
  neighbours with a point-to-point handshake, including a stage whose neighbour lives on
  the same rank (the V-shaped schedules: rank r holds chunks r and 2pp-1-r, so the middle
  two are neighbours on one rank); gloo cannot send to itself. 2.13 skips that handshake.
- ``dcp_stager_reusable``: 2.11's ``DefaultStager`` closes itself after every ``stage``
  call, emptying its deep-copy dispatch table, so a second background save with the same
  stager dies in ``deepcopy_with_tensor_offload`` with ``KeyError: <class 'type'>`` (the
  plain ``dict`` at the top of the state finds no copier and is reduced to its class).
  2.13 keeps the stager (and its cached host buffers) until ``close()``.
- ``functional_collectives``: the functional collectives DTensor calls (a private module,
  imported only here), which 2.11 names differently (``all_gather_tensor`` where 2.13 has
  ``all_gather_single``); communication counting (parallel/comm_stats.py) wraps them.
- ``all_gather_flat`` / ``reduce_scatter_flat``: torch 2.13 renamed
  ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and deprecates the old
  names; 2.11 has only those. Looked up per call, because the communication counter swaps
  wrappers into the module attributes on measured steps.

- ``resolve_group``, ``symm_mem_*``, ``enable_micro_pipeline_tp``: async TP's private torch
  names (a process group from its name, the symmetric-memory fused ops, inductor's
  micro-pipeline TP switch), the same on 2.11-2.13; the CUDA ones are not run on a CPU machine.

Other private torch names are used where they are wrapped and listed here: the stage's
``_post_metadata_inference_cleanup`` (parallel/pipeline/stage_aux.py), the stager's ``_config``
(checkpoint/sharded.py); ``torch._grouped_mm`` is probed and called here (``grouped_mm``); the GEMM
census (metrics/gemm_census.py) reads ``torch._C._current_graph_task_id`` (as models/moe.py does) and
handles ``torch._ops.HigherOrderOperator`` calls (2.11-2.13 alike).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

TORCH_VERSION: tuple[int, int] = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer."""
    return TORCH_VERSION >= (major, minor)


def pipeline_stage_fixups(stage: Any) -> None:
    """Make ``stage`` (a ``PipelineStage``) run on this torch: on 2.11, drop the start-up
    handshake with a neighbour on the same rank (see the module docstring)."""
    init_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if init_ops is None or torch_at_least(2, 13):
        return

    def ops() -> list:
        return [op for op in init_ops() if getattr(op, "group_peer", None) != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = ops


def split_backward_through_custom_functions() -> bool:
    """Whether the zero-bubble schedules' weight pass (``stage_backward_weight``) can take the
    gradient through a custom ``autograd.Function`` node, such as the chunked loss's. On 2.11 it
    reads ``node._input_metadata``, which such a node refuses; 2.13 can (2.12 untested)."""
    return torch_at_least(2, 13)


def dcp_stager_reusable() -> bool:
    """Whether one DCP ``DefaultStager`` serves many saves (seen on 2.13; 2.12 untested, treated as
    2.11); else make one per save."""
    return torch_at_least(2, 13)


def functional_collectives() -> tuple[Any, dict[str, str]]:
    """The functional-collectives module DTensor calls, and which of its functions gather and
    reduce-scatter a local tensor: ``all_gather_single`` / ``reduce_scatter_single`` on 2.13
    (whose ``*_tensor`` names are deprecated wrappers around them, so only one set may be
    counted), ``all_gather_tensor`` / ``reduce_scatter_tensor`` on 2.11. Both take the tensor
    as ``self``."""
    import torch.distributed._functional_collectives as funcol  # private module: imported here only

    if hasattr(funcol, "all_gather_single"):
        return funcol, {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    return funcol, {"all_gather": "all_gather_tensor", "reduce_scatter": "reduce_scatter_tensor"}


def mesh_slice_names(dims: tuple[str, ...], flattened: dict[str, tuple[str, ...]], degrees: dict[str, int]) -> tuple:
    """The names to slice a root mesh by for the sub-mesh ``dims`` (flattened names allowed).
    torch 2.11 checks that the sliced dimensions' strides ascend, and a flattened dimension
    of size 1 (e.g. ``dp`` under cp 2 x tp 2) carries a stride that fails it; such a name
    (or one whose constituents are all size 1 but one) is replaced by that constituent,
    which is the same ranks. 2.13 slices them as given."""
    if torch_at_least(2, 13) or len(dims) < 2:
        return dims
    out = []
    for name in dims:
        parts = flattened.get(name)
        if parts is not None:
            big = [p for p in parts if degrees.get(p, 1) > 1]
            name = big[0] if len(big) == 1 else parts[-1] if not big else name
        out.append(name)
    return tuple(out)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``inp`` concatenated into ``out`` (world × inp elements)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """The sum over ranks of ``inp``, each rank keeping its 1/world slice in ``out``; with
    ``async_op`` the work, to wait for."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (probed once per device
    type and dtype on a tiny problem with an empty group; a private API, wrapped here only).

    The probe runs in the first MoE forward, which may be inside an activation-checkpointed
    block: its own saved tensors are kept from the checkpoint's hooks (else the recomputation,
    which skips the cached probe, saves fewer tensors and checkpointing refuses it), and it
    draws no random numbers."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is), torch.enable_grad():
                    x = torch.ones(32, 16, device=device, dtype=dtype, requires_grad=True)
                    w = torch.ones(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([8, 8, 32], device=device, dtype=torch.int32)
                    grouped_mm(x, w, offs).backward(torch.ones(32, 16, device=device, dtype=dtype))
                ok = w.grad is not None and bool(torch.isfinite(w.grad).all())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (private; probed by ``grouped_mm_supported``): one GEMM per group of
    rows of ``x`` (its ends in ``offs``) with the matching matrix of ``w``."""
    return torch._grouped_mm(x, w, offs=offs)


# ----------------------------------------------------------------------------- async TP


def resolve_group(group_name: str) -> Any:
    """The process group of a name (custom ops take groups by name)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def symm_mem_available() -> bool:
    """Whether torch's symmetric-memory fused matmul collectives run here (a CUDA build that
    defines them). Importing the module defines the ops."""
    if not (torch.cuda.is_available() and dist.is_available()):
        return False
    import importlib

    try:
        importlib.import_module("torch.distributed._symmetric_memory")  # defines torch.ops.symm_mem.*
    except ImportError:
        return False
    ops = getattr(torch.ops, "symm_mem", None)
    return ops is not None and hasattr(ops, "fused_all_gather_matmul") and hasattr(ops, "fused_matmul_reduce_scatter")


def symm_mem_all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], dim: int, group_name: str) -> tuple:
    """(all-gathered ``a`` along ``dim``, [gathered a @ b for b in bs]) by torch's fused CUDA kernel."""
    gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(a, bs, dim, group_name)
    return gathered, list(outs)


def symm_mem_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """(a @ b) summed over the group and scattered along ``dim``, by torch's fused CUDA kernel."""
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", dim, group_name)


def enable_micro_pipeline_tp(group: Any) -> None:
    """Inductor's micro-pipeline TP (torchtitan's async TP): compiled all-gather + matmul and
    matmul + reduce-scatter pairs become the symmetric-memory fused ops. Older torch also needs
    symmetric memory enabled for the tp group (2.13 deprecates that call as unneeded)."""
    import warnings

    import torch._inductor.config as inductor_config  # private: used here only
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group.group_name)
