"""parallel.offload = "cpu" on a world of one: FSDP2's CPUOffloadPolicy on a one-rank mesh
(parallel/rules.py offload_problem, Mesh.solo_mesh). A CPU run refuses offload before launch
(nothing to offload from), so the check is lifted here to run FSDP2's offload path on CPU:
it must equal the plain one-rank run in fp32 to 1e-6, also after a checkpoint resume."""

import json

import pytest

from conftest import tiny_config, train
from meshforge.config.layout import open_layout
from meshforge.errors import ConfigError
from meshforge.planner.hardware import get_hardware
from meshforge.planner.model_flags import from_preset
from meshforge.planner.search import search
from meshforge.resolve import resolve

COMMON = {"train.steps": 4, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.eval_batches": 1}
OFFLOAD = {"parallel.zero_stage": 3, "parallel.offload": "cpu", "train.precision": "fp32"}


def metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def cpu_offload_allowed(monkeypatch):
    from meshforge import resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "_offload_needs_a_gpu", lambda cfg, world: None)


def test_world_of_one_offload_equals_plain_run_and_resumes(tmp_path, corpus, cpu_offload_allowed):
    plain, off, resumed = tmp_path / "plain", tmp_path / "off", tmp_path / "resumed"
    train(tiny_config(plain, corpus, **COMMON, **{"train.precision": "fp32"}))
    train(tiny_config(off, corpus, **COMMON, **OFFLOAD, **{"checkpoint.interval": 2}))
    ref, got = metrics(plain), metrics(off)
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6, abs=1e-6)
    assert [g["grad_norm"] for g in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-6, abs=1e-6)
    assert got[-1]["state_mem_host_bytes"]["params"] == got[-1]["state_mem_bytes"]["params"] > 0
    load = {"checkpoint.load": str(off / "checkpoints" / "step-00000002")}
    train(tiny_config(resumed, corpus, **COMMON, **OFFLOAD, **load))
    again = metrics(resumed)
    assert [g["step"] for g in again] == [3, 4]
    assert [g["loss"] for g in again] == pytest.approx([r["loss"] for r in ref[2:]], rel=1e-6, abs=1e-6)


def test_offload_on_one_rank_passes_the_layout_rule_and_stage_is_named(tmp_path, corpus):
    from meshforge.config.run_plan import World

    gpu = World(size=1, device="cuda")
    assert resolve(tiny_config(tmp_path, corpus, **OFFLOAD), world=gpu).fsdp  # a one-rank FSDP2 mesh
    with pytest.raises(ConfigError, match=r"needs FSDP2's sharded state \(parallel.zero_stage = 2 or 3; here "):
        resolve(tiny_config(tmp_path, corpus, **{**OFFLOAD, "parallel.zero_stage": 0}), world=gpu)
    with pytest.raises(ConfigError, match=r"parallel.offload = 'cpu' on a CPU run"):
        resolve(tiny_config(tmp_path, corpus, **OFFLOAD), world=World(size=1, device="cpu"))


def test_planner_offloads_8b_on_one_h100():
    """8B needs 120 GiB of model states: on one 80 GB GPU only offload fits, on a one-rank
    FSDP2 mesh (ZeRO-2/3), with FSDP2's fp32 shards (16 bytes per parameter) on the host."""
    shape = from_preset("llama3.1-8b")
    ranked, _ = search(shape, get_hardware("h100-sxm"), 1, 8, 1, 4096, "bf16", open_layout())
    assert ranked and all(e.layout.offload == "cpu" and e.layout.zero_stage in (2, 3) for e in ranked)
    assert all(not e.not_runnable and e.memory["total"] < 80 for e in ranked)
    host = ranked[0].host_memory
    assert host["params"] == host["grads"] == pytest.approx(host["optimizer"] / 2)  # fp32 shards, Adam m + v
