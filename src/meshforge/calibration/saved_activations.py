"""The bytes a forward pass keeps for its backward, measured on any device (the truth the
planner's activation model is held to: ``calibration/activation_probe.py``, docs/planner.md).

Two views of one forward, merged by storage:

- ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves — an op's inputs
  and outputs, a compiled block's saved outputs of its partitioned forward (AOT autograd hands
  them to ``ctx.save_for_backward``), a non-reentrant checkpoint's inputs;
- a ``TorchDispatchMode`` (eager only: compiled code allocates outside the dispatcher) that
  keeps a weak reference to the storage of every op's output: a storage still alive after the
  forward, once the caller has dropped its outputs, is held by the autograd graph even where
  no hook sees it — selective checkpointing keeps its saved matmul outputs in a cache of its own.

Storages, not tensors, are counted, so views of one storage count once, and the storages of
parameters (and of views of them, e.g. a linear's transposed weight) are not activations.
The pack hook returns the tensor itself: measuring changes nothing the forward keeps.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class SavedStorage:
    """One storage the forward keeps: its bytes, the first tensor seen on it, how it was found."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    how: str  # "hook" (autograd saved it) or "held" (alive after the forward, seen only as an op's output)


@dataclass
class SavedReport:
    """What one forward keeps for backward, by storage."""

    storages: dict[int, SavedStorage] = field(default_factory=dict)  # key: the storage's data pointer

    @property
    def total(self) -> int:
        return sum(s.nbytes for s in self.storages.values())

    def table(self) -> list[tuple[int, tuple[int, ...], str, str]]:
        """(bytes, shape, dtype, how) per storage, largest first: where the bytes come from."""
        rows = [(s.nbytes, s.shape, str(s.dtype).removeprefix("torch."), s.how) for s in self.storages.values()]
        return sorted(rows, key=lambda r: -r[0])


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a dense tensor's storage, or None (no storage: meta, sparse, subclass)."""
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        inner = getattr(t, "_local_tensor", None)  # a DTensor: its local shard is what memory holds
        return _key(inner) if isinstance(inner, torch.Tensor) else None
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes()) if st.nbytes() else None


class _OutputStorages(TorchDispatchMode):
    """Weak references to the storage of every op output (eager forwards only)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[weakref.ref, SavedStorage]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) is not None:
                st = t.untyped_storage()
                self.refs.append((weakref.ref(st), SavedStorage(st.nbytes(), tuple(t.shape), t.dtype, "held")))
        return out


class SavedTensors:
    """Context manager around one forward: ``report(outputs_dropped=True)`` after it says what
    autograd keeps. ``params``: tensors whose storages are weights, not activations (the module's
    parameters and buffers; any ``nn.Parameter`` autograd saves is recognised on its own, e.g.
    FSDP2's gathered ones). ``track_outputs``: also watch op outputs (eager only, see module doc)."""

    def __init__(self, params: Iterable[torch.Tensor] = (), track_outputs: bool = True):
        self.weights: set[int] = {k[0] for k in map(_key, params) if k}
        self.saved: dict[int, SavedStorage] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._mode = _OutputStorages() if track_outputs else None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k is not None:
            base = t._base if t._base is not None else t
            if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
                self.weights.add(k[0])
            elif k[0] not in self.saved:
                self.saved[k[0]] = SavedStorage(k[1], tuple(t.shape), t.dtype, "hook")
        return t

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)

    def report(self, params: Iterable[torch.Tensor] = (), outputs: Iterable[torch.Tensor] = ()) -> SavedReport:
        """The storages kept: every saved one, plus (eager) every op output still alive. Call it
        after dropping the forward's outputs but keeping what holds the graph (the loss, named in
        ``outputs``: alive, but not kept for backward); ``params``: weights as they are now (FSDP2
        keeps its gathered parameters after a forward)."""
        gc.collect()
        self.weights |= {k[0] for k in map(_key, [*params, *outputs]) if k}
        found = {k: v for k, v in self.saved.items() if k not in self.weights}
        for ref, info in self._mode.refs if self._mode is not None else ():
            st = ref()
            if st is not None and st.data_ptr() not in self.weights and st.data_ptr() not in found:
                found[st.data_ptr()] = info
        return SavedReport(found)


def measure(
    forward: Callable[[], torch.Tensor],
    params: Iterable[torch.Tensor],
    eager: bool,
    after: Callable[[], Iterable[torch.Tensor]] = tuple,
) -> SavedReport:
    """The storages ``forward()`` keeps for backward: it returns the tensor backward would start
    from (the loss), whose graph is held while the report is taken and freed after. ``after()``:
    the weights as they are once the forward ran (see ``SavedTensors.report``)."""
    with SavedTensors(params, track_outputs=eager) as probe:
        loss = forward()
    report = probe.report(after(), [loss])
    del loss
    return report
