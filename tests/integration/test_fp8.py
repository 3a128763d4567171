"""fp8 through torchao (parallel/fp8.py), emulated on CPU: which linears convert, the
refusals before launch, and training of the debug preset single-process, under FSDP2, and
under tp 2 x pp 2 resuming the FSDP2 run's fp8 checkpoint, within a few percent of bf16."""

import json
import sys

import pytest
import torch

from conftest import cli_args, run_cli, tiny_config, train
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models.llama import ModelShape, build_model
from meshforge.parallel.fp8 import fp8_plan, model_fp8_plan, require_torchao, unmatched_warnings
from meshforge.resolve import resolve

pytest.importorskip("torchao.float8")

DEBUG = {  # the debug preset's shape, short sequences
    "model.preset": "debug",
    "model.hidden": None,
    "model.layers": None,
    "model.heads": None,
    "model.kv_heads": None,
    "model.ffn_hidden": None,
    "train.steps": 6,
    "train.seq_len": 32,
    "train.global_batch_size": 4,
    "train.eval_batches": 0,
    "optim.warmup_steps": 2,
    "optim.decay_steps": 6,  # runs cut short follow the same schedule
    "checkpoint.save_final": False,
    "metrics.tensorboard": False,
    "metrics.report": False,
}


def metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def events(d):
    return [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines()]


def debug_overrides(run_dir, corpus, **extra):
    o = {k: v for k, v in DEBUG.items() if v is not None}
    o.update({"data.path": str(corpus), "run.dir": str(run_dir), "metrics.log_interval": 1, "metrics.console": False})
    o.update(extra)
    return o


# ----------------------------------------------------------------------------- the boundary


def test_plan_converts_block_linears_and_says_why_others_stay():
    args = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=40, vocab_size=256, max_seq_len=64)
    plan = fp8_plan(build_model(args, device="meta"), ["output", "*router*", "layers.1.attention.wo"])
    assert plan.excluded["output"] == "train.fp8_exclude pattern 'output'"
    assert plan.excluded["layers.1.attention.wo"] == "train.fp8_exclude pattern 'layers.1.attention.wo'"
    assert "not multiples of 16" in plan.excluded["layers.0.feed_forward.w1"]  # ffn_hidden 40
    assert plan.converted == [f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wq", "wk", "wv", "wo")][:-1]
    assert plan.unmatched == ["*router*"]
    assert unmatched_warnings(plan) == []  # a default pattern may match nothing silently
    plan = fp8_plan(build_model(args, device="meta"), ["layers.*.mlp"])
    assert "'layers.*.mlp' matches no module" in unmatched_warnings(plan)[0]


def test_refusals_name_the_key(tmp_path, corpus, monkeypatch):
    fp8 = {"train.precision": "fp8", "train.fp8_exclude": ["layers.*", "output"]}
    with pytest.raises(ConfigError, match=r"train.fp8_exclude leaves no linear layer in fp8"):
        resolve(tiny_config(tmp_path, corpus, **fp8))
    with pytest.raises(ConfigError, match=r"train.fp8_recipe = 'rowwsie'.*did you mean 'rowwise'"):
        load_config(None, {"train.fp8_recipe": "rowwsie"})
    with pytest.raises(ConfigError, match=r"parallel.offload = 'cpu' on a CPU run: the state already lives in host"):
        resolve(tiny_config(tmp_path, corpus, **{"parallel.offload": "cpu", "parallel.zero_stage": 3}), 2)
    with pytest.raises(ConfigError, match=r"parallel.offload = 'cpu' needs FSDP2's sharded state"):
        resolve(tiny_config(tmp_path, corpus, **{"parallel.offload": "cpu", "parallel.zero_stage": 1}), 2)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"needs torchao.*pip install"):
        require_torchao()
    with pytest.raises(ConfigError, match=r"needs torchao"):
        model_fp8_plan(ModelShape(64, 2, 4, 2, 64, 256, 64), [])


# ----------------------------------------------------------------------------- fp8 all-gather


def test_fp8_all_gather_only_where_fsdp_gathers_over_ranks(monkeypatch):
    """A one-rank shard group (a world of one, HSDP with dp_shard 1, DDP) never gathers in fp8:
    the GPU suite's 1B fp8 row ran 43% busy with the per-weight fp8 casts of a world of one."""
    from meshforge.config.layout import Layout
    from meshforge.parallel import fp8 as fp8_mod
    from meshforge.parallel.rules import gathers_weights

    monkeypatch.setattr(fp8_mod, "fp8_emulated", lambda device: device.type != "cuda")  # an fp8-capable GPU
    assert not gathers_weights(Layout())  # a world of one
    assert not gathers_weights(Layout(dp_shard=2))  # DDP (stage 0)
    assert not gathers_weights(Layout(dp_replicate=2, zero_stage=3))  # HSDP over one-rank shard groups
    assert gathers_weights(Layout(dp_shard=2, zero_stage=3)) and gathers_weights(Layout(dp_shard=2, zero_stage=2))
    assert gathers_weights(Layout(cp=2, zero_stage=3))  # FSDP shards over dp_shard x cp
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fp8_mod.fp8_config("tensorwise", cuda, gathers=True).enable_fsdp_float8_all_gather
    assert not fp8_mod.fp8_config("tensorwise", cuda, gathers=False).enable_fsdp_float8_all_gather
    assert not fp8_mod.fp8_config("tensorwise", cpu, gathers=True).enable_fsdp_float8_all_gather  # gloo: no fp8
    assert not fp8_mod.fp8_all_gather("rowwise", cuda, gathers=True)
    # the run plan's decision: a CUDA world of one casting once is FSDP2-sharded on a one-rank
    # mesh, and must not gather in fp8; ZeRO-3 over 2 ranks does (on an fp8 GPU only)
    from meshforge.config.run_plan import World

    def plan(world: int, native: bool = True, **over):
        cfg = load_config(None, {"train.precision": "fp8", "train.mixed_precision": "cast_once", **over})
        return resolve(cfg, world=World(size=world, device="cuda", fp8_native=native))

    solo = plan(1)
    assert solo.fsdp and not solo.fp8_all_gather
    assert plan(2, **{"parallel.zero_stage": 3}).fp8_all_gather
    assert not plan(2, native=False, **{"parallel.zero_stage": 3}).fp8_all_gather  # emulated: no fp8 gather
    assert not plan(2, **{"parallel.zero_stage": 3, "train.precision": "bf16"}).fp8_all_gather
    offload = plan(2, **{"parallel.zero_stage": 3, "parallel.offload": "cpu"})
    assert offload.fsdp and not offload.fp8_all_gather  # host-resident shards: no fp8 gather


def test_fp8_scales_precomputed_before_every_forward_where_it_gathers(monkeypatch, tmp_path, corpus):
    """Under fp8 all-gather every step precomputes the weight scales (one fused amax) before its
    forward, so a resume, a rollback or a DiLoCo sync is covered too; elsewhere never. (gloo has
    no fp8 collectives, so on CPU the call itself is stood in for.)"""
    from meshforge.train import step as step_mod

    calls = []
    monkeypatch.setattr(step_mod, "precompute_fp8_scales", lambda model: calls.append(model))
    o = debug_overrides(tmp_path / "no", corpus, **{"train.precision": "fp8", "train.steps": 3})
    train(load_config(None, o))
    assert calls == []  # a CPU world of one: no fp8 all-gather
    from meshforge import resolve as resolve_mod

    monkeypatch.setattr(resolve_mod, "_fp8_all_gather", lambda cfg, world, fsdp: True)
    train(load_config(None, {**o, "run.dir": str(tmp_path / "yes")}))
    assert len(calls) == 3 and all(isinstance(m, torch.nn.Module) for m in calls)


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    """The debug preset in bf16 and in fp8 (tensorwise), one process."""
    out = {}
    for precision in ("bf16", "fp8"):
        d = tmp_path_factory.mktemp(precision) / "run"
        train(load_config(None, debug_overrides(d, corpus, **{"train.precision": precision})))
        out[precision] = d
    return out


def test_fp8_trains_within_a_few_percent_of_bf16_and_says_emulated(single):
    bf16, fp8 = metrics(single["bf16"]), metrics(single["fp8"])
    assert len(fp8) == DEBUG["train.steps"]
    assert fp8[-1]["loss"] < fp8[0]["loss"] - 0.3  # it learns
    assert [f["loss"] for f in fp8] == pytest.approx([b["loss"] for b in bf16], rel=0.03)
    assert [f["loss"] for f in fp8] != [b["loss"] for b in bf16]  # fp8 really ran
    ev = {e["event"]: e for e in events(single["fp8"])}
    assert ev["fp8_modules"]["emulated"] is True and ev["fp8_modules"]["recipe"] == "tensorwise"
    assert len(ev["fp8_modules"]["converted"]) == 4 * 7 and list(ev["fp8_modules"]["excluded"]) == ["output"]


@pytest.mark.slow
def test_fp8_under_fsdp_then_tp_and_pp(single, tmp_path, corpus):
    """FSDP2 (ZeRO-3, tensorwise) saves at step 3; tp 2 x pp 2 (rowwise) resumes it, resharded, to the end."""
    ref = [m["loss"] for m in metrics(single["fp8"])]
    fsdp = tmp_path / "fsdp"
    o = debug_overrides(fsdp, corpus, **{"train.precision": "fp8", "parallel.zero_stage": 3, "checkpoint.interval": 3})
    r = run_cli("train", "--nproc", "2", *cli_args({**o, "train.steps": 3}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["loss"] for m in metrics(fsdp)] == pytest.approx(ref[:3], rel=0.01)
    d = tmp_path / "tp-pp"
    o = debug_overrides(d, corpus, **{"train.precision": "fp8", "train.fp8_recipe": "rowwise"})
    o.update({"parallel.tp": 2, "parallel.pp": 2, "checkpoint.load": str(fsdp / "checkpoints")})
    r = run_cli("train", "--nproc", "4", *cli_args(o))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in metrics(d)] == [4, 5, 6]
    assert [m["loss"] for m in metrics(d)] == pytest.approx(ref[3:], rel=0.03)
    assert next(e for e in events(d) if e["event"] == "fp8_modules")["recipe"] == "rowwise"
