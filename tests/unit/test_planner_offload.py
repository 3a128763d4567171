"""The planner's CPU offload (parallel.offload = "cpu", FSDP2's CPUOffloadPolicy): searched only
when nothing fits without it, only where the layout rules allow it, its device memory the
non-offloaded layout's less the states moved to the host (the same formula functions), and an
emitted config that the config loader, the layout rules and `meshforge train --dry-run` take."""

import json
from dataclasses import replace

import pytest
import torch

from meshforge.cli.main import main
from meshforge.config import load_config
from meshforge.config.layout import Layout, open_layout
from meshforge.errors import ConfigError
from meshforge.parallel.rules import offload_problem
from meshforge.planner import offload_costs
from meshforge.planner.estimate import GIB, estimate, plan_layout
from meshforge.planner.hardware import get_hardware
from meshforge.planner.memory import stage_params, stage_state_bytes
from meshforge.planner.model_flags import from_preset
from meshforge.planner.plan import parse_plan_args, run
from meshforge.planner.search import search
from meshforge.resolve import resolve

SHAPE = from_preset("llama3.2-1b")  # 1.2B parameters: ~18.5 GiB of model states (16 bytes each)
SEQ, BATCH, GPUS = 1024, 2, 2
SMALL = replace(get_hardware("h100-sxm"), hbm_gib=8.0)  # 2 GPUs of 8 GiB: the states alone need 9.2 each
ARGV = ["--model", "llama3.2-1b", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "1024", "--global-batch", "2"]


def plan(hw, **fixed):
    return search(SHAPE, hw, GPUS, GPUS, BATCH, SEQ, "bf16", open_layout(**fixed))


def test_offload_is_picked_only_when_nothing_fits_without_it():
    with pytest.raises(ConfigError, match="fits no layout on 2 x h100-sxm"):
        plan(SMALL, offload="none")
    ranked, _ = plan(SMALL)  # auto
    assert ranked and all(e.fits and e.layout.offload == "cpu" for e in ranked)
    for e in ranked:  # the layout rule's verdict (parallel/rules.py), not the planner's own
        L = e.layout
        assert L.zero_stage >= 2 and offload_problem(L) is None
        assert e.memory["total"] <= SMALL.hbm_gib < sum(stage_state_bytes(SHAPE, L, "bf16").values()) / GIB
        assert e.host_memory["per_node"] == pytest.approx(e.host_memory["total"] * GPUS)
    roomy = get_hardware("h100-sxm")  # where something fits without offload, auto does not offload
    ranked, _ = plan(roomy)
    assert ranked and all(e.layout.offload == "none" for e in ranked)
    forced, _ = plan(roomy, offload="cpu")
    assert forced and all(e.layout.offload == "cpu" and e.layout.zero_stage >= 2 for e in forced)
    assert forced[0].tokens_per_s_per_gpu < ranked[0].tokens_per_s_per_gpu  # copies and a CPU optimizer step


def test_offload_is_refused_where_the_rules_or_the_hardware_refuse_it():
    with pytest.raises(ConfigError, match=r"--offload cpu --zero 1: parallel.offload = 'cpu' needs FSDP2"):
        plan(SMALL, offload="cpu", zero_stage=1)
    with pytest.raises(ConfigError, match=r"--offload cpu: cpu has no host to offload to"):
        plan(get_hardware("cpu"), offload="cpu")
    with pytest.raises(ConfigError, match=r"--offload 'disk': one of auto, none, cpu"):
        plan(SMALL, offload="disk")
    moe = Layout(dp_shard=4, ep=2, zero_stage=3, offload="cpu")  # the experts' own FSDP units are not offloaded
    assert offload_problem(moe).kind == "unsupported"


@pytest.mark.parametrize("zero, micro", [(3, 1), (2, 2)])
def test_offloaded_device_bytes_are_the_states_less_what_moves_to_the_host(zero, micro):
    hw = get_hardware("h100-sxm")
    lay = plan_layout(tp=1, pp=1, dp=2, zero_stage=zero, micro_batch_size=1, num_microbatches=micro)
    kept = estimate(SHAPE, lay, SEQ, 2 * micro, "bf16", hw, GPUS)
    off = estimate(SHAPE, replace(lay, offload="cpu"), SEQ, 2 * micro, "bf16", hw, GPUS)
    states = stage_state_bytes(SHAPE, lay, "bf16")
    psi, per_layer = stage_params(SHAPE, 1, 1)
    staging = offload_costs.staging_bytes(per_layer, 2)
    assert off.memory["total"] * GIB == pytest.approx(kept.memory["total"] * GIB - sum(states.values()) + staging)
    assert off.memory["activations"] == kept.memory["activations"]
    assert off.host_memory["total"] * GIB == pytest.approx(sum(states.values()))
    assert sum(states.values()) == pytest.approx(16 * psi / 2)  # FSDP2's fp32 shards + Adam, ZeRO-2 or 3
    # time: the copies (fp32 shard up per gather, gradient shard down once) and the CPU step replace the GPU's
    gathers = (2 if zero == 3 else 1) * micro
    assert off.time["offload_copy_total"] == pytest.approx((gathers + 1) * 4 * psi / 2 / hw.host_link_bw)
    assert 0 < off.time["offload_copy"] <= off.time["offload_copy_total"]
    assert off.time["optimizer"] == pytest.approx(2 * 16 * psi / 2 / hw.host_mem_bw)
    assert off.time["optimizer"] > kept.time["optimizer"]
    assert sum(off.budget.values()) == pytest.approx(1.0, abs=1e-6)


def test_emitted_offload_config_loads_resolves_and_dry_runs(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    argv = [*ARGV, "--gpu", "h100-sxm", "--offload", "cpu", "--json", "--emit-config", str(out)]
    assert run(parse_plan_args(argv)) == 0  # (80 GiB fit it without offload: asked for)
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert best["offload"] == "cpu"
    assert best["memory_bytes"]["host"] > best["memory_bytes"]["device"] > 0
    from meshforge.config.run_plan import World

    cfg = resolve(load_config(str(out)), world=World(size=GPUS, device="cuda"))  # the layout rules take it
    assert cfg.layout.offload == "cpu" and cfg.layout.zero_stage == best["zero_stage"] >= 2
    assert run(parse_plan_args(["--config", str(out), "--gpus", "2", "--gpus-per-node", "2", "--json"])) == 0
    again = json.loads(capsys.readouterr().out)["layouts"]
    assert len(again) == 1 and again[0]["offload"] == "cpu" and again[0]["zero_stage"] == best["zero_stage"]
    code = main(["train", "--config", str(out), "--nproc", "2", "--dry-run", f"--run.dir={tmp_path / 'never'}"])
    assert code == (0 if torch.cuda.is_available() else 2)  # a CPU refuses offload: the dry run's verdict
    text = capsys.readouterr().out
    assert 'offload = "cpu"' in text
    if not torch.cuda.is_available():  # a CPU machine: train refuses offload before launch, and says so here
        assert "refuses it: parallel.offload = 'cpu' on a CPU run" in text and "planner: no estimate" in text
    assert not (tmp_path / "never").exists()
