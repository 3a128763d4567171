"""Count the bytes every collective moves, by mesh axis and kind, so communication can be
checked against theory.

FSDP2, DDP's comm hook, ZeroRedundancyOptimizer and meshforge itself call collectives
through ``torch.distributed``'s Python functions; DTensor (tensor parallelism, loss
parallel) calls the functional collectives (``compat.functional_collectives``) by module
attribute. Wrapping both sets of functions (here, and only here) sees all of
them without touching the libraries. Bytes are *wire bytes per
rank* under ring algorithms, the unit the textbook formulas use: for a payload of S
bytes on n ranks an all-reduce moves 2(n-1)/n·S, an all-gather or reduce-scatter
(n-1)/n·S (S = the full, unsharded size), a broadcast or point-to-point S.

Counting is a deliberate seam, off by default: ``with counter.counting():`` puts the
wrappers in place, starts from zero, and takes them out again on exit, so outside that
block the ``torch.distributed`` functions are the originals and cost nothing extra. The
trainer counts only its logged steps (see docs/metrics.md, "The hot path").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshforge.compat import functional_collectives

_ISEND = dist.isend
# function name -> (kind, argument holding the full-size payload, wire factor(n))
_RING = {
    "all_reduce": ("all_reduce", "tensor", lambda n: 2 * (n - 1) / n),
    "all_gather": ("all_gather", "tensor_list", lambda n: (n - 1) / n),  # ring attention's allgather mode
    "all_gather_single": ("all_gather", "output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("all_gather", "output_tensor", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("reduce_scatter", "input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("reduce_scatter", "input", lambda n: (n - 1) / n),
    "all_to_all_single": ("all_to_all", "input", lambda n: (n - 1) / n),
    "broadcast": ("broadcast", "tensor", lambda n: 1.0),
    "send": ("p2p", "tensor", lambda n: 1.0),
    # isend itself is not wrapped: P2POp checks it is handed the very function
    "batch_isend_irecv": ("p2p", "p2p_op_list", lambda n: 1.0),
}

# the functional collectives DTensor uses, by kind (their names differ by torch version:
# compat.functional_collectives); the all-gather's argument is the local shard
_FUNCOL_KINDS = {
    "all_reduce": ("all_reduce", "self", lambda n: 2 * (n - 1) / n),
    "all_gather": ("all_gather", "self", lambda n: n - 1.0),
    "reduce_scatter": ("reduce_scatter", "self", lambda n: (n - 1) / n),
    "all_to_all_single": ("all_to_all", "self", lambda n: (n - 1) / n),
}


def _funcol_table() -> tuple[Any, dict[str, tuple]]:
    funcol, names = functional_collectives()
    return funcol, {names.get(kind, kind): entry for kind, entry in _FUNCOL_KINDS.items()}


def _process_group(group: Any) -> Any:
    """A functional collective's group argument ((mesh, dim), a 1-D mesh, or a group) as a ProcessGroup."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        return group.get_group()
    return group


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


class CommCounter:
    """Counts the collectives called inside ``counting()`` blocks; read them with ``snapshot``."""

    _active: CommCounter | None = None
    # (module, function name) -> (original, wrapper); built once, swapped in per counted block
    _patches: dict[tuple[Any, str], tuple[Any, Any]] = {}

    def __init__(self, axis_of_group: dict[Any, str] | None = None, trace: bool = False):
        self.axis_of_group = {_group_key(g): axis for g, axis in (axis_of_group or {}).items()}
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, int] = defaultdict(int)
        self.trace: list[tuple[str, str, int]] | None = [] if trace else None  # (axis, kind, payload bytes)
        self._lock = threading.Lock()
        self.blocked: dict[str, float] = defaultdict(float)  # per axis: time inside blocking calls and waits
        # per axis: the last asynchronous launch nobody waited for through ``wait``, and its completion
        self.last_launch: dict[str, float] = {}
        self.last_done: dict[str, float] = {}
        self._last_work: dict[str, Any] = {}

    def axis(self, group: Any) -> str:
        """The mesh axis a process group belongs to ("world" for the default group)."""
        return self.axis_of_group.get(_group_key(group), "world" if group is None else "other")

    def record(self, table: dict, fn_name: str, bound: inspect.BoundArguments) -> str | None:
        """Count one call's wire bytes; returns its axis (None: a one-rank group, nothing moved)."""
        kind, arg, factor = table[fn_name]
        group = _process_group(bound.arguments.get("group"))
        n = dist.get_world_size(group) if fn_name != "batch_isend_irecv" else 2
        if n <= 1:
            return None
        payload = _nbytes(bound.arguments.get(arg))
        if fn_name == "batch_isend_irecv":  # pipeline transfers: count what this rank sends
            ops = bound.arguments[arg]
            group = _process_group(ops[0].group) if ops else None
            payload = sum(_nbytes(op.tensor) for op in ops if op.op is _ISEND)
            if not payload:
                return None
        return self.add(self.axis(group), kind, payload, factor(n))

    def add(self, axis: str, kind: str, payload: float, factor: float) -> str:
        with self._lock:
            self.bytes[axis][kind] += payload * factor
            self.calls[kind] += 1
            if self.trace is not None:
                self.trace.append((axis, kind, payload))
        return axis

    def timed(self, out: Any, t0: float, axis: str) -> None:
        """Book a call's time: all of it when it blocked; for asynchronous work, when it was
        launched and (a callback) when it completed."""
        now = time.perf_counter()
        works = out if isinstance(out, list) else [out]
        if out is None or not all(hasattr(w, "get_future") for w in works):
            self.blocked[axis] += now - t0
            return
        self.last_launch[axis] = now
        self.last_done.pop(axis, None)
        self._last_work[axis] = works[-1]
        for w in works:
            try:
                w.get_future().add_done_callback(functools.partial(self._done, axis))
            except RuntimeError:  # point-to-point work has no future; its waits go uncounted
                pass

    def _done(self, axis: str, _: Any) -> None:
        self.last_done[axis] = time.perf_counter()

    def waited(self, work: Any, axis: str, seconds: float) -> None:
        """A wait through ``wait``: its time is exposed; the work is no async tail any more."""
        self.blocked[axis] += seconds
        if self._last_work.get(axis) is work:
            self.last_launch.pop(axis, None)

    def exposed_by_axis(self) -> dict[str, float]:
        """Per axis, the time this rank was held by communication in the counted block: blocking
        calls and waits, plus the tail of asynchronous work that completed after its axis's
        last launch and was waited for elsewhere (e.g. DDP's last gradient bucket, which backward
        waits for)."""
        out = dict(self.blocked)
        for axis, t in self.last_launch.items():
            done = self.last_done.get(axis)
            if done is not None:
                out[axis] = out.get(axis, 0.0) + max(0.0, done - t)
        return out

    def exposed_s(self) -> float:
        """All axes' exposed time (``exposed_by_axis``)."""
        return sum(self.exposed_by_axis().values())

    def reset(self) -> None:
        self.blocked.clear()
        self.last_launch, self.last_done, self._last_work = {}, {}, {}
        with self._lock:
            self.bytes.clear()
            self.calls.clear()
            if self.trace is not None:
                self.trace.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {axis: dict(kinds) for axis, kinds in self.bytes.items()}

    @contextlib.contextmanager
    def counting(self) -> Iterator[CommCounter]:
        """Count (from zero) the collectives called inside the block; outside it nothing is wrapped."""
        self.reset()
        CommCounter._active = self
        CommCounter._swap(install=True)
        try:
            yield self
        finally:
            CommCounter._swap(install=False)
            CommCounter._active = None

    @classmethod
    def _swap(cls, install: bool) -> None:
        """Put the wrappers in (or the originals back) as module attributes, where FSDP2,
        DDP's hook, DTensor and pipelining look the functions up at call time."""
        if not cls._patches:
            funcol, funcol_table = _funcol_table()
            for module, table in ((dist, _RING), (funcol, funcol_table)):
                for name in table:
                    fn = getattr(module, name, None)
                    if fn is not None:
                        cls._patches[(module, name)] = (fn, _wrap(fn, table, name))
        for (module, name), (original, wrapper) in cls._patches.items():
            setattr(module, name, wrapper if install else original)


def _group_key(group: Any) -> Any:
    return getattr(group, "group_name", group)


def _wrap(fn: Any, table: dict, name: str) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counter = CommCounter._active
        if counter is None:
            return fn(*args, **kwargs)
        try:
            axis = counter.record(table, name, sig.bind(*args, **kwargs))
        except TypeError:
            axis = None  # let the real call raise its own error
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if axis is not None:
            counter.timed(out, t0, axis)
        return out

    return wrapper


# ------------------------------------------------------------------ meshforge's own overlapped collectives


def book(kind: str, payload: float, group: Any) -> None:
    """Count an all-gather or reduce-scatter that meshforge runs as a ring of point-to-point
    sends (async TP) as that collective: ``payload`` its full (unsharded) size in bytes, of which
    a ring moves (n-1)/n per rank. A no-op outside ``counting()``."""
    counter = CommCounter._active
    if counter is None:
        return
    n = dist.get_world_size(group)
    if n > 1:
        counter.add(counter.axis(group), kind, payload, (n - 1) / n)


def wait(work: Any, group: Any) -> None:
    """``work.wait()``; inside ``counting()`` the time it blocks is booked as exposed on the
    group's axis (the overlapped paths wait through here, so what they fail to hide shows)."""
    counter = CommCounter._active
    if counter is None:
        work.wait()
        return
    t0 = time.perf_counter()
    work.wait()
    counter.waited(work, counter.axis(group), time.perf_counter() - t0)
