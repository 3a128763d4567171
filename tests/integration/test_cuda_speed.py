"""CUDA paths of issue 27's speed items (run by `pytest -m cuda` on a GPU machine; skipped
without one by conftest): bf16 cast once per micro-batch on one GPU (FSDP2 on a one-rank
mesh) against autocast, CPU offload on a world of one, whole-block fullgraph compile, and
the device syncs of an unlogged step (torch.cuda.set_sync_debug_mode)."""

import json
import warnings

import pytest
import torch

from conftest import tiny_config, train
from meshforge.train import loop

pytestmark = pytest.mark.cuda

CUDA = {"train.device": "cuda", "train.steps": 8, "optim.warmup_steps": 2, "train.eval_batches": 1}
BF16 = {**CUDA, "train.precision": "bf16", "train.global_batch_size": 4, "train.micro_batch_size": 2}


def records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_cast_once_on_one_gpu_matches_autocast(tmp_path, corpus):
    runs = {}
    for mp in ("autocast", "cast_once"):
        train(tiny_config(tmp_path / mp, corpus, **BF16, **{"train.mixed_precision": mp}))
        runs[mp] = records(tmp_path / mp)
    got, ref = runs["cast_once"], runs["autocast"]
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=5e-3)
    assert got[-1]["state_mem_bytes"]["gathered_params"] * 2 == got[-1]["state_mem_bytes"]["params"]


def test_offload_on_one_gpu_matches_and_keeps_the_state_on_the_host(tmp_path, corpus):
    runs = {}
    for offload in ("none", "cpu"):
        over = {"parallel.zero_stage": 3, "parallel.offload": offload}
        train(tiny_config(tmp_path / offload, corpus, **BF16, **over))
        runs[offload] = records(tmp_path / offload)
    assert [m["loss"] for m in runs["cpu"]] == pytest.approx([m["loss"] for m in runs["none"]], rel=1e-3)
    last = runs["cpu"][-1]
    assert last["state_mem_host_bytes"]["params"] == last["state_mem_bytes"]["params"] > 0
    assert last["state_mem_device_bytes"]["params"] == 0


def test_fullgraph_compile_on_cuda(tmp_path, corpus):
    d = tmp_path / "run"
    train(tiny_config(d, corpus, **BF16, **{"train.compile": True}))
    plan = next(e for e in events(d) if e["event"] == "compile")
    assert plan["fullgraph_blocks"] == 2 and plan["fallback"] == []
    assert records(d)[-1]["loss"] < records(d)[0]["loss"]


def test_unlogged_steps_sync_only_for_the_guard(tmp_path, corpus, monkeypatch):
    """One synchronizing call per unlogged step: the health guard's read of the gradient norm."""
    step_once, seen = loop.Trainer.step_once, []

    def counted(self, measure=True):
        if measure:
            return step_once(self, measure)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return step_once(self, measure)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            seen.append([str(w.message) for w in caught if "synchroniz" in str(w.message)])

    monkeypatch.setattr(loop.Trainer, "step_once", counted)
    over = {"metrics.log_interval": 8, "train.eval_batches": 0}
    train(tiny_config(tmp_path / "run", corpus, **{**BF16, **over}))
    assert seen and all(len(s) <= 1 for s in seen[1:]), seen  # (the first step also allocates state)
