"""The silent-corruption check's pieces without ranks: the fingerprint sees any one flipped bit, the
majority names the odd replica (and says when two cannot tell), the bitflip fault flips one bit."""

import pytest
import torch
from torch import nn

from meshforge.health import faults
from meshforge.health.sdc import SdcCheck, fingerprint, odd_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_sees_every_single_bit_flip(dtype):
    w = torch.randn(257, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = fingerprint([w])
    width = 8 * w.element_size()
    for i in (0, 100, 256):
        for bit in range(width):
            v = w.clone()
            ints = v.view({2: torch.int16, 4: torch.int32}[w.element_size()])
            ints[i] ^= 1 << bit if bit < width - 1 else -(1 << bit)  # the sign bit too
            assert not torch.equal(fingerprint([v]), base), (i, bit)
    assert torch.equal(fingerprint([w.clone()]), base)


def test_majority_names_the_odd_replica_and_two_cannot_tell():
    rows = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3]])
    assert odd_rows(rows) == ([1], [2], True)
    assert odd_rows(rows[:2]) == ([], [], True)
    assert odd_rows(rows[1:]) == ([1], [0, 1], False)  # two replicas: either may be the wrong one


def test_bitflip_fault_flips_one_bit_of_the_first_weight():
    assert faults.parse("bitflip:rank=1:step=3") == ("bitflip", {"rank": 1, "step": 3})
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    assert faults.flip_bit(model) == "0.weight"
    after = list(model.parameters())
    diff = (before[0].view(torch.int32) ^ after[0].detach().view(torch.int32)).flatten()
    assert diff.count_nonzero() == 1 and bin(int(diff[0])).count("1") == 1
    assert all(torch.equal(a, b) for a, b in zip(before[1:], after[1:], strict=True))


def test_check_names_the_odd_replica_group_once_when_logging():
    model = nn.Linear(4, 2)
    mine = None

    def across(fp):  # three groups, ours (row 1) flipped in the bias
        nonlocal mine
        mine = fp
        other = fp.clone()
        other[1] += 1
        return torch.stack([other, fp, other]), ["a", "b", "c"], 1

    check = SdcCheck(model, interval=5, group=None, distributed=False, rank=0, across=across, once=True)
    assert not check.due(4) and check.due(10)
    event = check.check(10)
    assert event["params"] == ["bias"] and event["replicas"] == ["b"] and event["ranks"] == [0] and event["decided"]
    assert check.check(15) is None  # the same finding again: logged once
    assert SdcCheck(model, 5, None, False, 0, None).due(10) is False  # nothing to compare with
