"""Silent data corruption (SDC): replicas must hold bit-identical parameters after each step.

Data-parallel replicas (DDP and ZeRO-1 ranks, HSDP's replicate groups, fault-tolerant replica
groups) start from the same weights, apply the same reduced gradients and run the same
element-wise optimizer, so after every step their copies of a parameter shard are equal bit for
bit. A rank whose memory (or ALU) silently flips a bit breaks that, and only the non-finite check
would ever notice, and only if the flip makes a NaN. Every ``health.sdc_interval`` steps each
rank takes a fingerprint of every parameter shard it holds -- the sum of its elements' bit
patterns read as integers, exact and independent of summation order, so one flipped bit changes
it by 2^k -- and the replicas gather them (one all-gather of one int64 per parameter). Where
rows differ, the majority value is the good one and the odd rows name the rank; with two
replicas there is no majority (``decided = false``) and both are named. One flag all-reduced over
the world makes every rank reach the same verdict, so a stop or rollback is taken together.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> same-width integer
# across: this rank's fingerprints -> the live replica groups' (one row each), their names, and which row is ours
Across = Callable[[torch.Tensor], tuple[torch.Tensor, list[Any], int]]


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per parameter: the sum of its local elements' bit patterns as integers (wrapping)."""
    sums = [local(p).detach().reshape(-1).view(INT_VIEW[p.element_size()]).sum(dtype=torch.int64) for p in params]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def odd_rows(rows: torch.Tensor) -> tuple[list[int], list[int], bool]:
    """For a (replicas x parameters) matrix: the columns where the replicas disagree, the rows off
    the majority in any of them, and whether every such column had a strict majority (else all
    its rows are named: two replicas cannot say which one is wrong)."""
    cols = (rows != rows[:1]).any(dim=0).nonzero().flatten().tolist()
    odd: set[int] = set()
    decided = True
    for c in cols:
        values = rows[:, c].tolist()
        top, count = Counter(values).most_common(1)[0]
        if 2 * count <= len(values):
            decided = False
            odd.update(range(len(values)))
        else:
            odd.update(i for i, v in enumerate(values) if v != top)
    return cols, sorted(odd), decided


class SdcCheck:
    """One per rank: ``check(step)`` on the steps ``due`` says (a collective: every rank calls it)."""

    def __init__(
        self,
        model: nn.Module,
        interval: int,
        group: dist.ProcessGroup | None,
        distributed: bool,
        rank: int,
        across: Across | None = None,
        once: bool = False,
    ):
        """``group``: the ranks that hold this rank's shards bit-identical (None: none in this
        world); ``across``: the other replica groups of a fault-tolerant run; ``once``: report a
        finding once (on_sdc = log, where the replicas stay apart), again only when it changes."""
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.interval, self.group, self.distributed, self.rank = interval, group, distributed, rank
        self.across, self.once = across, once
        self.reported: set[tuple] = set()  # findings already reported (on_sdc = log: again only when they change)

    def due(self, step: int) -> bool:
        has_replicas = self.group is not None or self.across is not None
        return self.interval > 0 and has_replicas and step % self.interval == 0

    def check(self, step: int) -> dict[str, Any] | None:
        """The ``sdc`` event's fields (without the action) when any replicas disagree, else None."""
        mine = fingerprint(self.params)
        found: list[dict[str, Any]] = []
        if self.group is not None:
            rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, mine, group=self.group)
            cols, odd, decided = odd_rows(torch.stack(rows))
            if cols:
                ranks = [dist.get_global_rank(self.group, i) for i in odd]
                found.append({"params": [self.names[c] for c in cols], "ranks": ranks, "decided": decided})
        if self.across is not None:
            rows_across, labels, me = self.across(mine)
            cols, odd, decided = odd_rows(rows_across) if len(labels) > 1 else ([], [], True)
            if cols:
                f = {"params": [self.names[c] for c in cols], "replicas": [labels[i] for i in odd], "decided": decided}
                found.append({**f, "ranks": [self.rank] if me in odd else []})
        flag = torch.tensor([int(bool(found))], device=mine.device)
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return None
        return self._event(step, found)

    def _event(self, step: int, found: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Every rank's findings gathered into one event (None when it repeats the last one)."""
        everyone: list[Any] = [(self.rank, socket.gethostname(), found)]
        if self.distributed:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.rank, socket.gethostname(), found))
        hosts = {r: h for r, h, _ in everyone}
        params, ranks, replicas, decided = set(), set(), set(), True
        for _, _, fs in everyone:
            for f in fs:
                params.update(f["params"])
                ranks.update(f["ranks"])
                replicas.update(f.get("replicas", ()))
                decided = decided and f["decided"]
        key = (tuple(sorted(params)), tuple(sorted(ranks)), tuple(sorted(map(str, replicas))))
        if self.once and key in self.reported:
            return None
        self.reported.add(key)
        event = {"event": "sdc", "step": step, "ranks": sorted(ranks), "hosts": sorted({hosts[r] for r in ranks})}
        event.update(params=sorted(params, key=self.names.index), decided=decided)
        if replicas:
            event["replicas"] = sorted(replicas, key=str)
        return event
