"""bf16 ZeRO-1 at the ZeRO paper's bytes (parallel/data/zero1.py), on CPU/gloo with 3 ranks.

One 3-rank run checks: the losses follow the single-process bf16 run within bf16 noise;
state bytes are 4Ψ + 12 Σ_g ceil(Ψ_g / N) (bf16 params and grads, fp32 master + Adam
moments of each padded group shard, plus Adam's step counters); the gradients are
reduce-scattered (fp32) and the parameters all-gathered (bf16): the elements of one
all-reduce, DDP's volume. A second run resumes from its mid-run checkpoint and continues
exactly; a third (2 ranks) reduces in bf16 and moves exactly a bf16 all-reduce's bytes.
"""

import json
import math

import pytest

from conftest import cli_args, run_cli, tiny_config, tiny_overrides, train
from meshforge.models.llama import build_model

pytestmark = pytest.mark.slow

N = 3
COMMON = {
    "train.steps": 6,
    "train.global_batch_size": 6,  # (2 ranks: 3 each)
    "train.micro_batch_size": 1,
    "train.grad_clip": 0.5,
    "train.eval_batches": 1,
    "train.precision": "bf16",
    "checkpoint.save_final": False,
}
ZERO1 = {"parallel.zero_stage": 1, "checkpoint.interval": 3}


def metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    ref = tmp_path_factory.mktemp("ref") / "run"
    train(tiny_config(ref, corpus, **COMMON))
    z1 = tmp_path_factory.mktemp("z1") / "run"
    r = run_cli("train", "--nproc", str(N), *cli_args(tiny_overrides(z1, corpus, **COMMON, **ZERO1)))
    assert r.returncode == 0, r.stderr[-4000:]
    return ref, z1


def group_sizes(run_dir):
    """Ψ of the two AdamW groups (decay: matrices; no decay: norms and the embedding)."""
    cfg = tiny_config(run_dir, run_dir)
    model = build_model(cfg.shape, device="meta")
    decay = no_decay = 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or "tok_embeddings" in name:
            no_decay += p.numel()
        else:
            decay += p.numel()
    return decay, no_decay


def test_bf16_zero1_matches_single_process_bf16(runs):
    ref, got = (metrics(d) for d in runs)
    assert len(got) == len(ref) == COMMON["train.steps"]
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=5e-3)
    assert [g["grad_norm"] for g in got] == pytest.approx([r["grad_norm"] for r in ref], rel=2e-2)
    assert all(r["grad_norm"] > 0.5 for r in ref)  # clipping was active


def test_state_bytes_are_the_papers(runs):
    sizes = group_sizes(runs[1])
    psi = sum(sizes)
    shards = [math.ceil(s / N) for s in sizes]
    assert sum(shards) * N > psi  # the padding is exercised
    mem = metrics(runs[1])[-1]["state_mem_bytes"]
    assert mem["params"] == 2 * psi and mem["grads"] == 2 * psi
    assert mem["optimizer"] == 12 * sum(shards) + 4 * len(sizes)  # master, m, v + one fp32 step per group
    ref = metrics(runs[0])[-1]["state_mem_bytes"]
    assert sum(ref.values()) == pytest.approx(16 * psi, rel=1e-4)  # autocast over fp32 weights


def test_communication_is_ddps_volume(runs):
    sizes = group_sizes(runs[1])
    padded = sum(math.ceil(s / N) * N for s in sizes)
    comm = metrics(runs[1])[-1]["comm_bytes_by_kind"]["dp_shard"]
    ring = (N - 1) / N
    assert comm["reduce_scatter"] == pytest.approx(ring * 4 * padded)  # fp32 gradients
    assert comm["all_gather"] == pytest.approx(ring * 2 * padded)  # bf16 parameters
    assert comm["all_reduce"] == pytest.approx(2 * ring * 8, abs=4)  # the loss and the norm scalars only


def test_resume_continues_exactly(runs, tmp_path, corpus):
    z1 = runs[1]
    d = tmp_path / "run"
    over = {**COMMON, **ZERO1, "checkpoint.load": str(z1 / "checkpoints" / "step-00000003")}
    r = run_cli("train", "--nproc", str(N), *cli_args(tiny_overrides(d, corpus, **over)))
    assert r.returncode == 0, r.stderr[-4000:]
    got, full = metrics(d), metrics(z1)
    assert [g["step"] for g in got] == [4, 5, 6]
    assert [g["loss"] for g in got] == pytest.approx([f["loss"] for f in full[3:]], rel=1e-6)


def test_bf16_reduction_moves_a_bf16_all_reduce(runs, tmp_path, corpus):
    n = 2
    d = tmp_path / "run"
    over = {**COMMON, **ZERO1, "train.steps": 2, "parallel.grad_reduce_dtype": "bf16", "checkpoint.interval": 0}
    r = run_cli("train", "--nproc", str(n), *cli_args(tiny_overrides(d, corpus, **over)))
    assert r.returncode == 0, r.stderr[-4000:]
    padded = sum(math.ceil(s / n) * n for s in group_sizes(d))
    comm = metrics(d)[-1]["comm_bytes_by_kind"]["dp_shard"]
    assert comm["reduce_scatter"] + comm["all_gather"] == pytest.approx(2 * (n - 1) / n * 2 * padded)
    assert [g["loss"] for g in metrics(d)] == pytest.approx([g["loss"] for g in metrics(runs[0])[:2]], rel=5e-3)
