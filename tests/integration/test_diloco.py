"""DiLoCo and Streaming DiLoCo (parallel/diloco/outer.py) against the single-process reference
(tests/diloco_reference.py: islands stepped one after another, the outer update by hand),
fp32 on CPU/gloo: one island with outer lr 1 and no momentum is plain training bit for bit;
islands fed identical data are one island; 2 islands x an inner layout (DDP, FSDP, one
rank) equal the reference for DiLoCo and Streaming DiLoCo (2 fragments, delay 1, bf16);
a resume mid-round is exact; the island axis' bytes equal the formula."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import cli_args, run_cli, tiny_config, tiny_overrides
from diloco_reference import island_trainers, simulate
from meshforge.checkpoint.weights import load_weights
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.parallel.diloco.outer import DiLoCo, fp8_decode, fp8_encode
from meshforge.resolve import resolve

H = 4
COMMON = {
    "train.steps": 8,
    "train.global_batch_size": 8,
    "train.eval_batches": 0,
    "optim.warmup_steps": 0,
    "diloco.inner_steps": H,
}
STREAMING = {"diloco.fragments": 2, "diloco.delay": 1, "diloco.sync_dtype": "bf16"}


def diloco_of(trainer, islands=1, island=0, group=None, **kw):
    d = trainer.plan.diloco
    keys = ("outer_lr", "outer_momentum", "nesterov", "fragments", "delay", "sync_dtype")
    opts = {**{k: getattr(d, k) for k in keys}, **kw}
    return DiLoCo(trainer.model, group, islands, island, d.inner_steps, trainer.plan.shape.layers, **opts)


def run_islands(trainers, dilocos, steps, per, identical=True):
    """Step world-of-one trainers on the same (identical) or per-island batches, with their DiLoCo hooks."""
    sampler = trainers[0].state.sampler
    for step in range(1, steps + 1):
        for i, (tr, dl) in enumerate(zip(trainers, dilocos, strict=True)):
            idx = sampler.indices(sampler.consumed + (0 if identical else i) * per, per)
            batch = tr.data.train.get(idx)
            tr.runner.run(batch, False, tr.runner.packing.documents(batch))  # as Trainer.step_once
            if dl is not None:
                dl.after_step(step)
        sampler.consumed += per * len(trainers)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_one_island_outer_lr_1_is_plain_training_bit_for_bit(tmp_path, corpus):
    cfg = tiny_config(tmp_path / "run", corpus, **COMMON, **{"diloco.outer_lr": 1.0, "diloco.outer_momentum": 0.0})
    plain, outer = island_trainers(cfg, tmp_path / "a", 1) + island_trainers(cfg, tmp_path / "b", 1)
    run_islands([plain], [None], 8, 8)
    run_islands([outer], [diloco_of(outer)], 8, 8)
    a, b = weights(plain.model), weights(outer.model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    moved = diloco_of(outer, outer_lr=0.7)  # the test can fail: another outer lr changes the weights
    run_islands([outer], [moved], H, 8)
    run_islands([plain], [None], H, 8)
    a, b = weights(plain.model), weights(outer.model)
    assert not all(torch.equal(a[n], b[n]) for n in a)


def _identical_worker(rank, store_path, overrides, root, out):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    cfg = load_config(None, overrides)
    try:
        (tr,) = island_trainers(cfg, Path(root) / f"w{rank}", 1)
        run_islands([tr], [diloco_of(tr, islands=2, island=rank, group=dist.group.WORLD)], 8, 8)
        torch.save(weights(tr.model), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {**STREAMING, "diloco.sync_dtype": "fp32"}], ids=["diloco", "streaming"])
def test_islands_fed_identical_data_equal_one_island(tmp_path, corpus, extra):
    overrides = tiny_overrides(tmp_path / "run", corpus, **COMMON, **extra)
    cfg = load_config(None, overrides)
    (one,) = island_trainers(cfg, tmp_path / "one", 1)
    run_islands([one], [diloco_of(one)], 8, 8)
    store = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_identical_worker, args=(store, overrides, str(tmp_path), str(tmp_path / "w")), nprocs=2)
    want = weights(one.model)
    got = [torch.load(tmp_path / f"w.{rank}") for rank in range(2)]
    assert all(torch.equal(got[0][n], got[1][n]) for n in want)  # the islands agree exactly
    for n in want:  # and equal one island, up to the fp32 wire's rounding of the pseudo-gradient
        assert float((got[0][n] - want[n]).norm() / want[n].norm()) < 1e-6, n


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_against_reference(run: Path, ref_losses, ref_weights, rtol=1e-6):
    got = [r["loss"] for r in metrics(run)]
    assert got == pytest.approx(ref_losses, rel=1e-6)
    final = load_weights(run / "final").state_dict()
    for n, w in ref_weights.items():
        err = float((final[n] - w).norm() / w.norm())
        assert err < rtol, f"{n}: relative error {err:.2e}"


LAYOUTS = {  # name: (ranks, overrides): 2 islands x an inner layout
    "2x1": (2, {}),
    "2xddp2": (4, {"parallel.zero_stage": 0}),
    "2xfsdp2": (4, {"parallel.zero_stage": 3}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("extra", [{}, STREAMING], ids=["diloco", "streaming"])
def test_distributed_run_equals_the_reference(tmp_path, corpus, layout, extra):
    nproc, inner = LAYOUTS[layout]
    o = tiny_overrides(tmp_path / "run", corpus, **COMMON, **inner, **extra, **{"diloco.islands": 2})
    # one thread per rank, as the reference (diloco_reference.simulate): a many-core CPU would
    # otherwise give each rank cores // nproc threads, and a GEMM split over threads may sum in
    # another order than the reference's
    r = run_cli("train", "--nproc", str(nproc), *cli_args(o), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    losses, final = simulate(load_config(None, o), tmp_path / "ref")
    # Losses to 1e-6 everywhere; weights to 1e-6 where the inner computation is the reference's
    # op for op (one rank per island, one thread each: they come out bit for bit). Two inner ranks
    # sum gradients in another order, which Adam's ε bounds (conftest.ADAM_EPS: ≲ 4e-8 per element
    # per step), and a bf16 wire then rounds an fp32 pseudo-gradient that differs in its last bit
    # to the neighbouring bf16 value now and then: one such element is ~2e-5 of its tensor.
    bf16 = extra.get("diloco.sync_dtype") == "bf16"
    check_against_reference(tmp_path / "run", losses, final, 1e-6 if nproc == 2 else 1e-4 if bf16 else 1e-5)
    assert_island_bytes(tmp_path / "run", load_config(None, o), nproc // 2)


def assert_island_bytes(run: Path, cfg, inner_ranks: int) -> None:
    """The island axis carries 2(M-1)/M x the local shard's pseudo-gradient bytes per sync
    (all-reduce), one fragment's at a time: per round, the whole local model once."""
    from meshforge.models.flops import num_params

    args = cfg.shape
    local = num_params(args) * (1 if cfg.layout.zero_stage == 0 else 1 / inner_ranks)
    width = {"fp32": 4, "bf16": 2}[cfg.diloco.sync_dtype]
    m = cfg.layout.islands
    per_round = sum(r.get("comm_bytes_by_kind", {}).get("island", {}).get("all_reduce", 0) for r in metrics(run)[:H])
    assert per_round == pytest.approx(2 * (m - 1) / m * width * local)
    peak = max(r.get("comm_bytes_by_kind", {}).get("island", {}).get("all_reduce", 0) for r in metrics(run))
    assert peak < per_round if cfg.diloco.fragments > 1 else peak == per_round


@pytest.mark.slow
def test_resume_mid_round_is_exact(tmp_path, corpus):
    """Saved after step 3 of a 4-step round, with fragment 1's fp8 sync in flight: the resumed run
    repeats steps 4-8 exactly (weights bit for bit, losses equal)."""
    extra = {**COMMON, "diloco.islands": 2, "diloco.fragments": 2, "diloco.delay": 1, "diloco.sync_dtype": "fp8"}
    full = tiny_overrides(tmp_path / "full", corpus, **extra, **{"checkpoint.interval": 3})
    assert run_cli("train", "--nproc", "2", *cli_args(full)).returncode == 0
    ckpt = tmp_path / "full" / "checkpoints" / "step-00000003"
    assert (ckpt / "COMPLETE").exists()
    resumed = tiny_overrides(tmp_path / "resumed", corpus, **extra, **{"checkpoint.load": str(ckpt)})
    r = run_cli("train", "--nproc", "2", *cli_args(resumed))
    assert r.returncode == 0, r.stderr[-4000:]
    a = load_weights(tmp_path / "full" / "final").state_dict()
    b = load_weights(tmp_path / "resumed" / "final").state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [x["loss"] for x in metrics(tmp_path / "resumed")] == [x["loss"] for x in metrics(tmp_path / "full")[3:]]


def test_fp8_wire_round_trip_and_error_feedback():
    torch.manual_seed(0)
    x = torch.randn(1000) * 1e-3
    wire, sent = fp8_encode(x)
    assert wire.dtype == torch.uint8 and wire.numel() < x.numel() * 4 / 3
    assert torch.equal(fp8_decode(wire, x.numel()), sent)
    assert float((sent - x).norm() / x.norm()) < 0.05


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"diloco.islands": 3}, "diloco.islands"),
        ({"diloco.islands": 2, "diloco.fragments": 3}, "diloco.fragments"),
        ({"diloco.islands": 2, "diloco.fragments": 2, "diloco.inner_steps": 5}, "diloco.inner_steps"),
        ({"diloco.islands": 2, "diloco.fragments": 2, "diloco.delay": 2}, "diloco.delay"),
        ({"diloco.islands": 2, "diloco.outer_lr": 0.0}, "diloco.outer_lr"),
        ({"diloco.islands": 4, "train.global_batch_size": 6}, "train.global_batch_size"),
    ],
)
def test_rules_name_the_key(tmp_path, corpus, overrides, key):
    with pytest.raises(ConfigError, match=key):  # (a range is refused on load, a rule between keys by resolve)
        resolve(tiny_config(tmp_path / "run", corpus, **{"diloco.inner_steps": 4, **overrides}), 4)


def test_islands_are_the_outermost_mesh_dimension(tmp_path, corpus):
    dims = resolve(tiny_config(tmp_path / "r", corpus, **{"diloco.islands": 2}), 4).layout
    assert list(dims.mesh_degrees()) == ["island", "pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert dims.dp_shard == 2 and dims.world_size == 4 and dims.data_ranks == 4


def test_planner_compares_ddp_and_diloco_on_the_link(capsys):
    from meshforge.cli.main import main

    argv = ["plan", "--model", "debug", "--gpus", "8", "--islands", "4", "--inter-island-gbps", "1", "--json"]
    assert main(argv) == 0
    c = json.loads(capsys.readouterr().out)["islands"]
    assert c["diloco_bytes_per_step"] == pytest.approx(c["ddp_bytes_per_step"] / 50)  # fp32, H = 50
    assert c["ddp_step_s"] > c["diloco_step_s"] >= c["inner_step_s"] and c["speedup"] > 1
    assert main([*argv, "--fragments", "2", "--delay", "10", "--sync-dtype", "bf16"]) == 0
    s = json.loads(capsys.readouterr().out)["islands"]
    assert s["diloco_peak_bytes_per_sync"] == pytest.approx(c["diloco_peak_bytes_per_sync"] / 4)  # / F / 2 bytes
    assert s["diloco_step_s"] <= c["diloco_step_s"]


@pytest.mark.slow
def test_warmup_is_ddp_over_all_islands(tmp_path, corpus):
    """diloco.warmup_steps: the first steps are data parallelism over every island (gradients
    averaged across islands), so 2 islands warmed up for all 8 steps end with DDP's weights
    (2 ranks); with a 4-step warm-up and one round after it they do not. (The logged loss is
    island 0's, so losses are not compared.)"""
    ddp = tiny_overrides(tmp_path / "ddp", corpus, **COMMON)
    warm = {**COMMON, "diloco.islands": 2, "diloco.warmup_steps": 8}
    half = {**warm, "diloco.warmup_steps": 4}
    for name, o in (("ddp", {}), ("warm", warm), ("half", half)):
        r = run_cli("train", "--nproc", "2", *cli_args({**ddp, **o, "run.dir": str(tmp_path / name)}))
        assert r.returncode == 0, r.stderr[-4000:]
    a, b, c = (load_weights(tmp_path / n / "final").state_dict() for n in ("ddp", "warm", "half"))
    assert all(torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-6) for n in a)
    assert not all(torch.allclose(a[n], c[n], rtol=1e-5, atol=1e-6) for n in a)
