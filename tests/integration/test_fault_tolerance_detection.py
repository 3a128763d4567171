"""Failure detection across replica groups with real gloo ranks: a member that gave up a collective
(it saw a failure its peer cannot see: in gloo's ring, a survivor that is not the dead group's
neighbour waits for data from one that has already given up) flags it in the store, and the member
still waiting in that collective gives up at the flag instead of waiting out gloo's timeout."""

from __future__ import annotations

import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshforge.parallel.fault_tolerance import watch

GLOO_TIMEOUT = timedelta(seconds=60)  # a wait that ignores the flag ends here, with gloo's own error


def _member(rank: int, store_path: str, out: str) -> None:
    store = dist.FileStore(store_path, 2)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", store), rank, 2, GLOO_TIMEOUT)
    flags = types.SimpleNamespace(store=dist.PrefixStore("flags", store), seq=1)
    t = torch.ones(1000)
    pg.allreduce([t]).wait()  # a healthy collective first: the pair is up
    if rank == 0:  # it gave up collective 1 (a failure it saw elsewhere); it stays alive, its pair open
        watch._flag(flags)
        store.wait(["done"], timedelta(seconds=300))
        return
    try:
        watch._wait(pg.allreduce([t]), flags)
        result = "completed"
    except watch.PeerFailed:
        result = "gave up at the flag"
    except RuntimeError as e:
        result = f"gloo: {e}"[:300]
    Path(out).write_text(result)
    store.set("done", "1")


def test_a_member_waiting_on_a_peer_that_gave_up_leaves_at_its_flag(tmp_path):
    out = tmp_path / "result"
    mp.spawn(_member, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    assert out.read_text() == "gave up at the flag"
