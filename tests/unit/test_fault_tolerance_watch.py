"""Failure detection across replica groups without ranks: a member waiting on a collective gives up
at another member's failure flag (for this collective or the one before) or when the quorum's store
is gone, instead of waiting out its own timeout; a failed collective flags itself and tells the
manager; a stale flag of another collective number is not a failure."""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.distributed as dist

from meshforge.parallel.fault_tolerance import watch

LATE_S = 20.0  # the work completes by itself this late: a wait that ignores the flag returns then


class _Work:
    """A collective in flight that completes after ``after`` seconds (or, with ``error``, fails)."""

    def __init__(self, after: float = LATE_S, error: str | None = None):
        self.fut: torch.futures.Future = torch.futures.Future()
        self.error = error
        self.timer = threading.Timer(after, self._done)
        self.timer.start()

    def _done(self) -> None:
        if self.error:
            self.fut.set_exception(RuntimeError(self.error))
        else:
            self.fut.set_result(None)

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def wait(self) -> None:
        self.fut.wait()


def _pg(seq: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(store=dist.HashStore(), seq=seq)


@pytest.mark.parametrize("flagged", [7, 6], ids=["this-collective", "the-one-before"])
def test_a_waiting_member_gives_up_at_a_peers_flag(flagged):
    pg = _pg(7)
    work = _Work()
    threading.Timer(0.2, lambda: watch._flag(types.SimpleNamespace(store=pg.store, seq=flagged))).start()
    try:
        with pytest.raises(watch.PeerFailed):
            watch._wait(work, pg)
    finally:
        work.timer.cancel()


def test_a_stale_flag_is_not_a_failure_and_a_finished_collective_returns():
    pg = _pg(9)
    watch._flag(types.SimpleNamespace(store=pg.store, seq=7))  # an older collective's flag
    work = _Work(after=0.3)
    watch._wait(work, pg)  # returns when the work is done
    assert work.fut.done()


def test_a_store_that_is_gone_counts_as_a_flag():
    class Gone:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    work = _Work()
    try:
        with pytest.raises(watch.PeerFailed):
            watch._wait(work, types.SimpleNamespace(store=Gone(), seq=1))
    finally:
        work.timer.cancel()


class _Manager:
    """What ``watch.allreduce`` reads of torchft's manager."""

    def __init__(self, work: _Work, participating: bool = True):
        self._pg = _pg(0)
        self._pg.allreduce = lambda tensors, opts: work
        self.participating, self.error = participating, None

    def errored(self):
        return self.error

    def wait_quorum(self) -> None:
        pass

    def is_participating(self) -> bool:
        return self.participating

    def num_participants(self) -> int:
        return 2

    def report_error(self, e: Exception) -> None:
        self.error = e


def test_a_failed_collective_flags_itself_and_tells_the_manager():
    m = _Manager(_Work(after=0.05, error="Connection closed by peer"))
    assert not watch.allreduce(m, torch.ones(3))
    assert isinstance(m.error, RuntimeError) and m._pg.store.check(["meshforge_failed_1"])
    assert not watch.allreduce(m, torch.ones(3))  # errored: nothing more this step


def test_a_healing_member_adds_zeros_unless_everyone_counts():
    t = torch.ones(3)
    assert watch.allreduce(_Manager(_Work(after=0.0), participating=False), t, dist.ReduceOp.AVG)
    assert torch.equal(t, torch.zeros(3))  # (the fake collective adds nothing: the zeros are its own)
    t = torch.full((3,), 4.0)
    assert watch.allreduce(_Manager(_Work(after=0.0), participating=False), t, dist.ReduceOp.AVG, everyone=True)
    assert torch.equal(t, torch.full((3,), 2.0))  # averaged over the 2 participants
