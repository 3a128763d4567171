"""bf16 with one cast per micro-batch (train.mixed_precision = "cast_once", parallel/rules.py
casts_once): a world of one and DDP's layout run on FSDP2's mixed-precision policy instead of
autocast. Checked against the autocast reference within bf16 noise (the tolerances of
tests/integration/test_zero1_bf16.py), and fp32 runs unchanged by the new rule."""

import json

import pytest

from conftest import cli_args, run_cli, tiny_config, tiny_overrides, train

COMMON = {"train.steps": 4, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.eval_batches": 1}
BF16 = {**COMMON, "train.precision": "bf16", "train.grad_clip": 0.5, "train.mixed_precision": "cast_once"}


def metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def close_in_bf16(got, ref):
    assert len(got) == len(ref)
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=5e-3)
    assert [g["grad_norm"] for g in got] == pytest.approx([r["grad_norm"] for r in ref], rel=2e-2)


@pytest.fixture(scope="module")
def autocast_ref(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("autocast") / "run"
    train(tiny_config(d, corpus, **{**BF16, "train.mixed_precision": "autocast"}))
    return metrics(d)


def test_world_of_one_casts_once_and_matches_autocast(tmp_path, corpus, autocast_ref):
    d = tmp_path / "run"
    train(tiny_config(d, corpus, **BF16))
    got = metrics(d)
    close_in_bf16(got, autocast_ref)
    mem = got[-1]["state_mem_bytes"]
    assert mem["gathered_params"] * 2 == mem["params"]  # the bf16 copy FSDP2 holds from forward to backward


@pytest.mark.slow
def test_ddp_layout_casts_once_and_matches_autocast(tmp_path, corpus, autocast_ref):
    d = tmp_path / "run"
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(d, corpus, **BF16)))
    assert r.returncode == 0, r.stderr[-4000:]
    got = metrics(d)
    close_in_bf16(got, autocast_ref)
    assert got[-1]["state_mem_bytes"]["gathered_params"] > 0  # FSDP2 (replicated over dp), not DDP


def test_fp32_world_of_one_is_unchanged(tmp_path, corpus):
    """fp32 takes no FSDP2: the default and the autocast setting give bit-equal runs."""
    runs = []
    for mp in ("cast_once", "autocast"):
        d = tmp_path / mp
        train(tiny_config(d, corpus, **COMMON, **{"train.precision": "fp32", "train.mixed_precision": mp}))
        runs.append(metrics(d))
    assert [m["loss"] for m in runs[0]] == [m["loss"] for m in runs[1]]
    assert (
        "gathered_params" not in runs[0][-1]["state_mem_bytes"] or not runs[0][-1]["state_mem_bytes"]["gathered_params"]
    )


def test_fp32_default_fused_adamw_equals_the_former_foreach(tmp_path, corpus):
    """fp32 on CPU now steps with fused AdamW (optim.implementation = auto): the run equals
    the former foreach run to 1e-6."""
    runs = []
    for impl in ("foreach", "auto"):
        d = tmp_path / impl
        over = {"train.precision": "fp32", "optim.implementation": impl, "train.steps": 6}
        train(tiny_config(d, corpus, **{**COMMON, **over}))
        runs.append(metrics(d))
    assert [m["loss"] for m in runs[1]] == pytest.approx([m["loss"] for m in runs[0]], rel=1e-6)
    assert [m["grad_norm"] for m in runs[1]] == pytest.approx([m["grad_norm"] for m in runs[0]], rel=1e-6)
