"""Every data-parallel layout reproduces the single-process run (fp32, gloo, CPU).

Each layout trains 3 steps with gradient accumulation (2 micro-batches per rank) and
active clipping; losses, gradient norms and the gathered final weights must match the
single-process reference to 1e-5 relative. The same runs check the state memory and the
communication each rank reports against the ZeRO accounting.
"""

import json

import pytest

from conftest import assert_same_weights, cli_args, run_cli, tiny_config, tiny_overrides, train
from meshforge.checkpoint.weights import load_weights
from meshforge.models.flops import num_params
from meshforge.parallel.rules import rank_layout

pytestmark = pytest.mark.slow

STEPS = 3


def common(global_batch):
    return {
        "train.steps": STEPS,
        "train.global_batch_size": global_batch,
        "train.micro_batch_size": 2,
        "train.grad_clip": 0.5,
        "train.eval_batches": 1,
        # the ZeRO memory/byte formulas below describe FSDP2 resharding every unit; the chunked loss
        # keeps a tied head's root unit gathered from forward to backward (tested on its own in
        # test_chunked_loss_parallel.py), so these layouts run the full-logits loss
        "train.loss_chunk_size": 0,
    }


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus):
    out = {}
    for gb in (8, 16):
        d = tmp_path_factory.mktemp(f"ref{gb}")
        train(tiny_config(d / "run", corpus, **common(gb)))
        out[gb] = d / "run"
    return out


LAYOUTS = {
    "ddp": (2, 8, {"parallel.zero_stage": 0}),
    "zero1": (2, 8, {"parallel.zero_stage": 1}),
    "zero2": (2, 8, {"parallel.zero_stage": 2}),
    "zero3": (2, 8, {"parallel.zero_stage": 3}),
    "hsdp2x2": (4, 16, {"parallel.zero_stage": 3, "parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, corpus):
    runs = {}

    def get(name):
        if name not in runs:
            nproc, gb, extra = LAYOUTS[name]
            d = tmp_path_factory.mktemp(name) / "run"
            r = run_cli("train", "--nproc", str(nproc), *cli_args(tiny_overrides(d, corpus, **common(gb), **extra)))
            assert r.returncode == 0, r.stderr[-4000:]
            runs[name] = d
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, references, layout_runs):
    nproc, gb, _ = LAYOUTS[name]
    ref, got = metrics(references[gb]), metrics(layout_runs(name))
    assert len(got) == STEPS
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [g["grad_norm"] for g in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
    assert all(r["grad_norm"] > 0.5 for r in ref)  # clipping was active
    val = [json.loads((d / "summary.json").read_text())["val_loss"] for d in (references[gb], layout_runs(name))]
    assert val[0] is not None and val[1] == pytest.approx(val[0], rel=1e-5)  # evaluation is layout-independent
    assert_same_weights(references[gb], layout_runs(name))


def _psi(run_dir):
    return num_params(load_weights(run_dir / "final").shape)


@pytest.mark.parametrize(
    "name, n, params, grads, opt, gathered",
    [  # bytes per parameter, as multiples of Ψ: (params, grads, optimizer, gathered during the step)
        ("ddp", 2, 4, 4, 8, 0),
        ("zero1", 2, 4, 4, None, 0),  # optimizer: partitioned by whole tensors, checked separately
        ("zero2", 2, 4 / 2, 4 / 2, 8 / 2, 4),
        ("zero3", 2, 4 / 2, 4 / 2, 8 / 2, 0),
        ("hsdp2x2", 4, 4 / 2, 4 / 2, 8 / 2, 0),  # sharded over dp_shard = 2, replicated across 2 groups
    ],
)
def test_state_memory_follows_the_zero_accounting(name, n, params, grads, opt, gathered, layout_runs):
    run = layout_runs(name)
    psi = _psi(run)
    mem = metrics(run)[-1]["state_mem_bytes"]
    assert mem["params"] == pytest.approx(params * psi, rel=1e-3)
    assert mem["grads"] == pytest.approx(grads * psi, rel=1e-3)
    assert mem["gathered_params"] == pytest.approx(gathered * psi, rel=1e-3)
    if opt is None:  # ZeRO-1: this rank's shard is a real fraction of 8Ψ
        assert 8 * psi / n * 0.8 < mem["optimizer"] < 8 * psi * 0.7
    else:
        assert mem["optimizer"] == pytest.approx(opt * psi, rel=1e-3)


def test_communication_matches_ring_formulas(layout_runs):
    """DDP all-reduces the gradients once: 2(n-1)/n * 4Ψ. ZeRO-3 all-gathers the parameters in
    forward and backward of each micro-batch, ZeRO-2 once per micro-batch, and both reduce the
    gradients once. On gloo (these tests) that reduction is an all-reduce of FSDP's flat buffer
    (2(n-1)/n * 4Ψ, see AllReduceScatter); on NCCL a reduce-scatter of half those bytes."""
    psi = _psi(layout_runs("ddp"))
    full = 4 * psi
    micro = 2
    ddp = metrics(layout_runs("ddp"))[-1]["comm_bytes_by_kind"]["dp_shard"]
    assert ddp["all_reduce"] == pytest.approx(2 * 0.5 * full, abs=16)  # + the loss all-reduce
    z3 = metrics(layout_runs("zero3"))[-1]["comm_bytes_by_kind"]["dp_shard"]
    assert z3["all_gather"] == pytest.approx(2 * micro * 0.5 * full, rel=1e-6)
    assert z3["all_reduce"] == pytest.approx(2 * 0.5 * full, abs=16)
    assert "reduce_scatter" not in z3
    z2 = metrics(layout_runs("zero2"))[-1]["comm_bytes_by_kind"]["dp_shard"]
    assert z2["all_gather"] == pytest.approx(micro * 0.5 * full, rel=1e-6)
    z1 = metrics(layout_runs("zero1"))[-1]["comm_bytes_by_kind"]["dp_shard"]
    assert z1["broadcast"] == pytest.approx(full, rel=1e-6)  # updated shards go back to every rank
    hsdp = metrics(layout_runs("hsdp2x2"))[-1]["comm_bytes_by_kind"]
    assert hsdp["dp_shard"]["all_reduce"] == pytest.approx(2 * 0.5 * full, abs=16)  # + the grad-norm scalar
    assert hsdp["dp_replicate"]["all_reduce"] == pytest.approx(2 * 0.5 * full / 2, rel=1e-6)


def test_sync_every_microbatch_reduces_each_time(tmp_path, corpus, references):
    d = tmp_path / "run"
    o = tiny_overrides(d, corpus, **common(8), **{"parallel.zero_stage": 2, "parallel.sync_every_microbatch": True})
    r = run_cli("train", "--nproc", "2", *cli_args(o))
    assert r.returncode == 0, r.stderr[-3000:]
    got, ref = metrics(d), metrics(references[8])
    assert [g["loss"] for g in got] == pytest.approx([x["loss"] for x in ref], rel=1e-5)
    psi = _psi(d)
    reduced = got[-1]["comm_bytes_by_kind"]["dp_shard"]["all_reduce"]  # gloo: reductions run as all-reduces
    assert reduced == pytest.approx(2 * (2 * 0.5 * 4 * psi), abs=16)


def test_rank_layout_puts_tp_innermost_and_pp_outermost():
    layout = rank_layout({"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2})
    assert [(r["pp"], r["dp_shard"], r["tp"]) for r in layout] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
