import numpy as np
import pytest

from meshforge.data.sampler import GlobalBatchSampler


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_take_contiguous_slices_of_the_same_global_batch(world):
    single = GlobalBatchSampler(1000, 16, seed=7)
    ranks = [GlobalBatchSampler(1000, 16, seed=7) for _ in range(world)]
    for _ in range(70):  # crosses an epoch boundary (1000 / 16 = 62.5 steps)
        ref = single.next_batch()
        got = np.concatenate([s.next_batch(r, world) for r, s in enumerate(ranks)])
        np.testing.assert_array_equal(got, ref)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = GlobalBatchSampler(100, 10, seed=1)
    e0 = np.concatenate([s.next_batch() for _ in range(10)])
    e1 = np.concatenate([s.next_batch() for _ in range(10)])
    assert sorted(e0) == list(range(100)) and sorted(e1) == list(range(100))
    assert not np.array_equal(e0, e1)
    assert s.epoch == 2


def test_order_depends_on_seed_only():
    a = GlobalBatchSampler(500, 8, seed=3).indices(0, 64)
    b = GlobalBatchSampler(500, 8, seed=3).indices(0, 64)
    c = GlobalBatchSampler(500, 8, seed=4).indices(0, 64)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_resume_from_state_continues_identically():
    a = GlobalBatchSampler(300, 12, seed=5)
    for _ in range(30):
        a.next_batch()
    state = a.state_dict()
    b = GlobalBatchSampler(300, 12, seed=5)
    b.load_state_dict(state)
    for _ in range(10):
        np.testing.assert_array_equal(a.next_batch(1, 2), b.next_batch(1, 2))


def test_state_from_other_data_is_refused():
    state = GlobalBatchSampler(300, 12, seed=5).state_dict()
    with pytest.raises(ValueError, match="data or train.seed changed"):
        GlobalBatchSampler(301, 12, seed=5).load_state_dict(state)
