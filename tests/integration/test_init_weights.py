"""One seed, one set of weights (models/init.py): a model built on the CPU directly, one built
on the meta device and materialised, one under CPU offload on a world of one (FSDP2 on a
one-rank mesh, the state in host memory) and one sharded over 2 ranks (ZeRO-3, and tp 2) hold
bit-identical full weights. Blocks are made small here so that every shard crosses several."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshforge.config import load_config
from meshforge.models import init
from meshforge.models.llama import Transformer, build_model, init_weights

SMALL_BLOCK = 4096  # elements per generator: the embedding (512 x 128) spans 16 blocks
SEED = 7


def _cfg(**over):
    """The run plan (machine checks off: offload on a CPU world of one is what is tested here)."""
    from meshforge.resolve import resolve

    o = {"model.preset": "debug", "train.precision": "fp32", "train.global_batch_size": 2, "train.device": "cpu"}
    o.update(over)
    world = 2 if any(k in over for k in ("parallel.dp_shard", "parallel.tp")) else 1
    return resolve(load_config(None, o), world, machine=False)


def _full(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().to("cpu", torch.float32).clone()
    return out


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(init, "BLOCK", SMALL_BLOCK)


def _reference() -> dict[str, torch.Tensor]:
    return _full(build_model(_cfg().shape, "cpu", seed=SEED))


def test_a_box_has_the_values_of_the_whole_tensor_there():
    full = init.draw_normal(3, "w", (37, 50), 0.02, block=64)
    for offset, local in [((0, 0), (37, 50)), ((5, 0), (9, 50)), ((0, 25), (37, 25)), ((36, 49), (1, 1))]:
        box = init.draw_normal(3, "w", (37, 50), 0.02, offset, local, block=64)
        rows, cols = (slice(o, o + n) for o, n in zip(offset, local, strict=True))
        assert torch.equal(box, full[rows, cols]), (offset, local)
    assert not torch.equal(full, init.draw_normal(4, "w", (37, 50), 0.02, block=64))


def test_block_zero_continues_the_whole_tensor_stream():
    """A parameter of up to one block keeps the values one generator gave it before blocks."""
    gen = torch.Generator().manual_seed(init.param_seed(0, "x"))
    old = torch.empty(3000).normal_(0.0, 1.0, generator=gen)
    assert torch.equal(init.draw_normal(0, "x", (3000,), 1.0, block=1024)[:1024], old[:1024])
    assert torch.equal(init.draw_normal(0, "x", (3000,), 1.0), old)


def test_direct_and_meta_built_models_are_identical(small_blocks):
    ref = _reference()
    with torch.device("cpu"):
        direct = Transformer(_cfg().shape)
    init_weights(direct, SEED)
    for name, t in _full(direct).items():
        assert torch.equal(t, ref[name]), name


def test_offload_on_a_world_of_one_is_identical(small_blocks):
    from meshforge.parallel.mesh import Mesh
    from meshforge.parallel.parallelize import parallelize

    cfg = _cfg(**{"parallel.zero_stage": 3, "parallel.offload": "cpu"})
    mesh = Mesh(0, 1, 0, torch.device("cpu"), cfg.layout)
    try:
        model = parallelize(build_model(cfg.shape, "meta"), cfg, mesh, seed=SEED)
        assert any(hasattr(p, "full_tensor") for p in model.parameters())  # FSDP2's DTensors
        got = _full(model)
    finally:
        dist.destroy_process_group()
    ref = _reference()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def _sharded_worker(rank: int, port: int, out: str) -> None:
    import os

    from meshforge.parallel.mesh import build_mesh
    from meshforge.parallel.parallelize import parallelize

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    init.BLOCK = SMALL_BLOCK
    got = {}
    for name, over in {"zero3": {"parallel.dp_shard": 2, "parallel.zero_stage": 3}, "tp2": {"parallel.tp": 2}}.items():
        cfg = _cfg(**over)
        mesh = build_mesh(cfg.layout, "cpu")
        model = parallelize(build_model(cfg.shape, "meta"), cfg, mesh, seed=SEED)
        got[name] = _full(model)
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_over_two_ranks_is_identical(tmp_path, small_blocks):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "weights.pt"
    mp.spawn(_sharded_worker, args=(port, str(out)), nprocs=2, join=True)
    ref = _reference()
    for layout_name, got in torch.load(out).items():
        assert got.keys() == ref.keys(), layout_name
        for k in ref:
            assert torch.equal(got[k], ref[k]), (layout_name, k)
