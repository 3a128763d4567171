"""bf16 ZeRO-1 reduces its gradients bucket by bucket during backward (parallel/data/zero1.py):
on 2 gloo ranks with 2 micro-batches, small buckets give the same weights and gradient norms
as one bucket reduced after backward (today's path), move the same bytes, start reduce-scatters
before backward ends (and only on the last micro-batch), and round-trip the layout-free state."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import rendezvous
from meshforge.models.llama import build_model
from meshforge.models.shape import ModelShape
from meshforge.parallel.comm_stats import CommCounter
from meshforge.parallel.data.flat_group import bucket_bounds
from meshforge.parallel.data.zero1 import FlatZero1

SHAPE = ModelShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=96)
MICRO = 2


def _train(bucket_mb: float, group, steps: int = 2):
    """Two steps of 2 micro-batches; returns the optimizer, the norms, the bytes, and whether a
    reduce-scatter had started before the last backward ended / during the first one."""
    torch.manual_seed(0)
    model = build_model(SHAPE, seed=0).to(torch.bfloat16)
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1}]
    groups.append({"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0})
    opt = FlatZero1(groups, torch.optim.AdamW, {"lr": 1e-2}, group, bucket_mb=bucket_mb, microbatches=MICRO)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    norms, early, first_mb = [], [], []
    launch = opt._launch

    def recording(i: int, k: int) -> None:  # gradients still to come when a bucket starts
        early.append(sum(map(sum, opt._left)))
        launch(i, k)

    opt._launch = recording
    counter = CommCounter({group: "dp"})
    with counter.counting():
        for _ in range(steps):
            for m in range(MICRO):
                tokens = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=gen)
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                (loss / MICRO).backward()
                if m < MICRO - 1:
                    first_mb.append(sum(len(x) for x in opt._launched))
            norms.append(float(opt.clip_grad_norm(float("inf"))))
            opt.step()
            opt.zero_grad()
    return opt, model, norms, counter.snapshot()["dp"], early, first_mb


def _worker(rank: int, n: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=n)
    try:
        group = dist.group.WORLD
        one, m1, norms1, bytes1, early1, _ = _train(1024, group)  # one bucket per group: reduced after backward
        many, m2, norms2, bytes2, early2, first = _train(0.002, group)  # ~1000-element buckets
        assert all(len(f.buckets) == 1 for f in one.flats) and len(many.flats[0].buckets) > 4
        assert first == [0, 0]  # nothing starts before the last micro-batch's backward
        # one bucket per group waits for (nearly) all gradients; small ones start while many are still to come
        assert max(early1) <= 2 and sum(x > 2 for x in early2) > len(early2) / 2
        assert bytes1 == bytes2
        # The same gradients (the weights below are bit-identical), but each rank squares and sums
        # another set of elements (its piece of every bucket, not one contiguous half), so the
        # norms agree to the round-off of a sum of N non-negative fp32 terms in another order:
        # torch's cascade sum bounds it by ~log2(N) ulp (some CPUs happen to land on the same bits).
        n = sum(p.numel() for p in m1.parameters())
        assert norms2 == pytest.approx(norms1, rel=(math.log2(n) + 4) * 2**-24, abs=0)
        for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
            assert torch.equal(a, b)
        s1, s2 = one.full_training_state(m1), many.full_training_state(m2)
        for name in s1["model"]:
            assert torch.equal(s1["model"][name], s2["model"][name])
            assert torch.equal(s1["optim"][name]["exp_avg_sq"], s2["optim"][name]["exp_avg_sq"])
        shards = [f.master.clone() for f in many.flats]
        for f in many.flats:
            f.master.zero_()
        many.load_full_training_state(m2, s2)  # this rank's pieces back from the full tensors
        assert all(torch.equal(a, f.master) for a, f in zip(shards, many.flats, strict=True))
    finally:
        dist.destroy_process_group()


def test_bucketed_reduce_scatter_equals_one_bucket():
    mp.spawn(_worker, args=(2, rendezvous()), nprocs=2, join=True)


@pytest.mark.parametrize("total, n, elems", [(12, 2, 5), (12, 3, 100), (30, 3, 7), (8, 4, 1)])
def test_buckets_cover_the_buffer_in_multiples_of_n(total, n, elems):
    bounds = bucket_bounds(total, n, elems)
    assert [a for a, _ in bounds] == [sum(s for _, s in bounds[:i]) for i in range(len(bounds))]
    assert sum(s for _, s in bounds) == total and all(s % n == 0 and s > 0 for _, s in bounds)
