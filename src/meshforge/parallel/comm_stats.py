"""Count the bytes every collective moves, by mesh axis and kind, so communication can be
checked against theory.

FSDP2, DDP's comm hook, ZeroRedundancyOptimizer and meshforge itself call collectives
through ``torch.distributed``'s Python functions; wrapping those functions (here, and
only here) sees all of them without touching the libraries. Bytes are *wire bytes per
rank* under ring algorithms, the unit the textbook formulas use: for a payload of S
bytes on n ranks an all-reduce moves 2(n-1)/n·S, an all-gather or reduce-scatter
(n-1)/n·S (S = the full, unsharded size), a broadcast or point-to-point S.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

# function name -> (kind, argument holding the full-size payload, wire factor(n))
_RING = {
    "all_reduce": ("all_reduce", "tensor", lambda n: 2 * (n - 1) / n),
    "all_gather_single": ("all_gather", "output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("all_gather", "output_tensor", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("reduce_scatter", "input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("reduce_scatter", "input", lambda n: (n - 1) / n),
    "all_to_all_single": ("all_to_all", "input", lambda n: (n - 1) / n),
    "broadcast": ("broadcast", "tensor", lambda n: 1.0),
    "send": ("p2p", "tensor", lambda n: 1.0),
    "isend": ("p2p", "tensor", lambda n: 1.0),
}


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


class CommCounter:
    """Process-wide counter; ``install`` once, then ``reset``/``snapshot`` around each step."""

    _installed = False
    _active: CommCounter | None = None

    def __init__(self, axis_of_group: dict[Any, str] | None = None):
        self.axis_of_group = dict(axis_of_group or {})
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def record(self, fn_name: str, bound: inspect.BoundArguments) -> None:
        kind, arg, factor = _RING[fn_name]
        group = bound.arguments.get("group")
        n = dist.get_world_size(group)
        if n <= 1:
            return
        axis = self.axis_of_group.get(group, "world" if group is None else "other")
        with self._lock:
            self.bytes[axis][kind] += _nbytes(bound.arguments.get(arg)) * factor(n)
            self.calls[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {axis: dict(kinds) for axis, kinds in self.bytes.items()}

    def by_axis(self) -> dict[str, float]:
        return {axis: sum(kinds.values()) for axis, kinds in self.snapshot().items()}

    def activate(self) -> CommCounter:
        CommCounter._install()
        CommCounter._active = self
        return self

    @classmethod
    def _install(cls) -> None:
        if cls._installed:
            return
        for name in _RING:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            sig = inspect.signature(fn)

            @functools.wraps(fn)
            def wrapper(*args, _fn=fn, _name=name, _sig=sig, **kwargs):
                counter = CommCounter._active
                if counter is not None:
                    try:
                        counter.record(_name, _sig.bind(*args, **kwargs))
                    except TypeError:
                        pass  # let the real call raise its own error
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        cls._installed = True
