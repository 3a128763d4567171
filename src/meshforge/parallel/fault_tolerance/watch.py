"""Collectives across the replica groups that give up as soon as any group knows one failed.

A group that dies mid-collective is seen at once only by the live groups that talk to it (their
gloo pair to it breaks); in gloo's ring the others wait for data from a live peer that has
already given up, until their own receive times out (``fault_tolerance.timeout_s``). So each
collective here runs in the background while its caller waits in short slices; between them it
looks in the quorum's store (the one every member's gloo group met at) for a flag that a member
which saw the failure set: any member that fails a collective flags it, and every member waiting
on that collective or the next one gives up within one slice instead of ``timeout_s``. The flag is
keyed by the collective's number in this quorum (every member runs the same sequence), so a later
quorum, or a later collective once the failed step is over, never sees a stale one.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SLICE_S = 0.05  # how often a waiting member looks for a failure flag


def watched_gloo(timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo group that also keeps a client of the store each quorum's group
    met at (for the failure flags) and numbers the collectives run in it."""
    from torchft.process_group import ProcessGroupGloo, create_store_client

    class WatchedGloo(ProcessGroupGloo):
        store: Any = None
        seq = 0

        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            self.store, self.seq = None, 0
            super().configure(store_addr, *args, **kwargs)
            self.store = create_store_client(store_addr, timeout=self._timeout)

    return WatchedGloo(timeout=timeout)


def allreduce(
    manager: Any, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, everyone: bool = False
) -> bool:
    """All-reduce ``tensor`` over the quorum's groups in place (``op`` SUM or AVG over the groups that
    take part; a healing group adds zeros, as torchft's own all-reduce does, unless ``everyone``);
    False, with the error reported to the manager (the step will not commit), when it failed or a
    member flagged a failure."""
    if manager.errored():
        return False
    pg = manager._pg  # private: torchft's gloo group for this quorum (watched_gloo's)
    try:
        manager.wait_quorum()
        if not everyone and not manager.is_participating():
            tensor.zero_()
        pg.seq += 1
        work = pg.allreduce([tensor], _opts(dist.ReduceOp.SUM))
        _wait(work, pg)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for every kind of failure
        _flag(pg)
        manager.report_error(e)
        return False
    if op == dist.ReduceOp.AVG:
        tensor /= manager.num_participants()
    return True


def _opts(op: dist.ReduceOp) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


class PeerFailed(RuntimeError):
    """Another member of the quorum flagged a failed collective."""


def _wait(work: Any, pg: Any) -> None:
    """Wait for ``work``, looking for a failure flag between slices; raises what the collective raised."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    while not done.wait(SLICE_S):
        if _flagged(pg):
            raise PeerFailed(f"a member of the quorum flagged collective {pg.seq} (or the one before) as failed")
    work.wait()


def _keys(seq: int) -> list[str]:
    return [f"meshforge_failed_{seq}"]


def _flagged(pg: Any) -> bool:
    """Whether a member flagged this collective or the one before (whose failed member will not come to
    this one); a store that stopped answering (its host died) counts as a flag."""
    try:
        return any(pg.store.check([key]) for key in _keys(pg.seq) + _keys(pg.seq - 1))  # (check: all of them)
    except Exception:  # noqa: BLE001 - the store's host is gone: so is a member
        return True


def _flag(pg: Any) -> None:
    try:
        if pg is not None and pg.store is not None:
            pg.store.set(_keys(pg.seq)[0], "1")
    except Exception:  # noqa: BLE001 - the store's host died: the others see that themselves
        pass
