"""The communication counter is a seam that costs nothing outside ``counting()``."""

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from meshforge.parallel.comm_stats import CommCounter


def test_collectives_are_wrapped_only_while_counting():
    before = (dist.all_reduce, dist.batch_isend_irecv, funcol.all_reduce)
    counter = CommCounter()
    with counter.counting() as c:
        assert c is counter and CommCounter._active is counter
        assert dist.all_reduce is not before[0] and dist.all_reduce.__wrapped__ is before[0]
        assert funcol.all_reduce is not before[2]
    assert (dist.all_reduce, dist.batch_isend_irecv, funcol.all_reduce) == before
    assert CommCounter._active is None
    with counter.counting():  # again: the same wrappers go back in
        assert dist.all_reduce.__wrapped__ is before[0]
    assert dist.all_reduce is before[0]
