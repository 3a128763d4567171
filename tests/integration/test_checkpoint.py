"""Checkpointing and fault tolerance: atomic sharded saves, exact resume after SIGKILL (also
mid-save, also under the elastic agent), resharding across layouts, verification with
fallback, retention, export (CPU, gloo, deterministic fp32)."""

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import assert_same_weights, cli_args, run_cli, tiny_config, tiny_overrides, train
from meshforge.checkpoint import store
from meshforge.checkpoint.saver import checkpoint_to_load, young_daly_steps
from meshforge.checkpoint.store import CheckpointError
from meshforge.checkpoint.weights import load_weights
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models.hf import load_hf_checkpoint

STEPS = 12
COMMON = {
    "train.steps": STEPS,
    "train.global_batch_size": 8,
    "train.deterministic": True,
    "train.eval_batches": 1,
    "optim.warmup_steps": 2,
    "model.heads": 4,
    "model.kv_heads": 2,
}


def losses(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "one record per step, in order"
    return [r["loss"] for r in recs]


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted single-process run."""
    d = tmp_path_factory.mktemp("ref") / "run"
    train(tiny_config(d, corpus, **COMMON))
    return d


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus):
    """A single-process run that checkpoints every 4 steps (steps 4, 8, 12)."""
    d = tmp_path_factory.mktemp("saved") / "run"
    train(tiny_config(d, corpus, **COMMON, **{"checkpoint.interval": 4, "checkpoint.keep": 5}))
    return d


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- on disk


def test_saves_are_complete_verified_and_retained(saved, reference):
    root = saved / "checkpoints"
    assert [c.step for c in store.list_complete(root)] == [4, 8, 12]
    for c in store.list_complete(root):
        meta = store.verify(c.path)
        assert meta["step"] == c.step and meta["world_size"] == 1
        assert (c.path / ".metadata").exists() and meta["files"][".metadata"]["bytes"] > 0
    assert losses(saved) == losses(reference)  # saving does not disturb training
    ev = [e for e in events(saved) if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in ev] == [4, 8, 12] and all(e["blocking_s"] > 0 for e in ev)


def test_background_saves_hold_the_state_of_their_step(saved, tmp_path, corpus):
    """dcp.async_save in a world of one (no process group): complete, verified checkpoints
    whose tensors equal the synchronous run's at the same step, so the host copy was taken
    before training moved on."""
    d = tmp_path / "run"
    train(
        tiny_config(d, corpus, **COMMON, **{"checkpoint.interval": 4, "checkpoint.keep": 5, "checkpoint.async": True})
    )
    assert losses(d) == losses(saved)
    assert [c.step for c in store.list_complete(d / "checkpoints")] == [4, 8, 12]
    for step in (4, 8, 12):
        name = store.step_dir_name(step)
        assert store.verify(d / "checkpoints" / name)["step"] == step
        a, b = tmp_path / f"async-{step}.pt", tmp_path / f"sync-{step}.pt"
        dcp_to_torch_save(d / "checkpoints" / name, a)
        dcp_to_torch_save(saved / "checkpoints" / name, b)
        sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        flat_a, flat_b = _flatten(sa), _flatten(sb)
        assert flat_a.keys() == flat_b.keys()
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), f"step {step}"


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}


def test_retention_keeps_the_newest(tmp_path, corpus):
    d = tmp_path / "run"
    train(tiny_config(d, corpus, **COMMON, **{"checkpoint.interval": 2, "checkpoint.keep": 2}))
    assert [c.step for c in store.list_complete(d / "checkpoints")] == [10, 12]


def test_incomplete_checkpoints_are_never_listed_or_loaded(saved, tmp_path):
    run = copy_run(saved, tmp_path / "run")
    root = run / "checkpoints"
    # a save cut short before its mark, and a half-written temporary directory
    (root / "step-00000012" / store.COMPLETE).unlink()
    (root / ".tmp-step-00000016").mkdir()
    (root / ".tmp-step-00000016" / "__0_0.distcp").write_bytes(b"partial")
    assert [c.step for c in store.list_complete(root)] == [4, 8]
    path, meta = checkpoint_to_load("latest", root, lambda *a, **k: None)
    assert path.name == "step-00000008" and meta["step"] == 8
    with pytest.raises(CheckpointError, match=r"step-00000012 has no COMPLETE mark"):
        checkpoint_to_load(str(root / "step-00000012"), root, lambda *a, **k: None)
    assert store.clean_incomplete(root) == [root / ".tmp-step-00000016"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_latest_falls_back_with_a_warning(saved, tmp_path, damage):
    run = copy_run(saved, tmp_path / "run")
    shard = run / "checkpoints" / "step-00000012" / "__0_0.distcp"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp (has \d+ bytes|does not match|is missing)"):
        store.verify(shard.parent)
    warned = []
    path, meta = checkpoint_to_load("latest", run / "checkpoints", lambda name, **k: warned.append((name, k)))
    assert meta["step"] == 8 and path.name == "step-00000008"
    assert warned[0][0] == "checkpoint_skipped" and "__0_0.distcp" in warned[0][1]["reason"]


def test_newer_format_and_missing_directory_are_named(saved, tmp_path):
    run = copy_run(saved, tmp_path / "run")
    ck = run / "checkpoints" / "step-00000004"
    meta = json.loads((ck / "meta.json").read_text())
    meta["version"] = 99
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json was written by a newer meshforge"):
        store.verify(ck)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        store.verify(tmp_path / "nope")


# ----------------------------------------------------------------------------- resume


def test_resume_after_sigkill_is_bit_identical(saved, reference, tmp_path, corpus):
    """Single process: killed right after step 6 (before logging it), the same command
    continues from step 4."""
    d = tmp_path / "run"
    args = cli_args(tiny_overrides(d, corpus, **COMMON, **{"checkpoint.interval": 4}))
    r = run_cli("train", *args, env={"MESHFORGE_FAULT": "kill:rank=0:step=6"})
    assert r.returncode == -9
    assert [c.step for c in store.list_complete(d / "checkpoints")] == [4]
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(d) == losses(reference)  # bit-identical, and one record per step
    resumed = [e for e in events(d) if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == 4 and resumed[0]["metrics_dropped"] == 1  # step 5's record


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill:rank=0:save=8", "kill:rank=0:step=10"], ids=["mid-async-save", "mid-run"])
def test_async_save_sigkill_resume_is_bit_identical(fault, reference, tmp_path, corpus):
    """Background saves (DCP's stager, reused across saves where torch allows: compat.py):
    SIGKILLed while step 8's shards are written (or at step 10, the step-8 save maybe still
    in flight), the same command resumes from the newest complete checkpoint and reproduces
    the uninterrupted run bit for bit."""
    d = tmp_path / "run"
    args = cli_args(tiny_overrides(d, corpus, **COMMON, **{"checkpoint.interval": 4, "checkpoint.async": True}))
    r = run_cli("train", *args, env={"MESHFORGE_FAULT": fault})
    assert r.returncode == -9, r.stderr[-3000:]
    complete = [c.step for c in store.list_complete(d / "checkpoints")]
    assert complete == [4] if "save" in fault else complete in ([4], [4, 8])
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(d) == losses(reference)
    resumed = [e for e in events(d) if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == complete[-1]
    assert [c.step for c in store.list_complete(d / "checkpoints")] == [4, 8, 12]


def test_shape_mismatch_is_refused_naming_the_file(saved, tmp_path, corpus):
    run = copy_run(saved, tmp_path / "run")
    cfg = tiny_config(run, corpus, **COMMON, **{"model.ffn_hidden": 96, "checkpoint.interval": 4})
    with pytest.raises(CheckpointError, match=r"step-00000012/meta.json was written for another model shape.*ffn"):
        train(cfg)


def test_max_restarts_needs_checkpoints(tmp_path, corpus):
    r = run_cli("train", "--nproc", "2", "--max-restarts", "1", *cli_args(tiny_overrides(tmp_path / "r", corpus)))
    assert r.returncode == 2 and "needs checkpoint.interval > 0" in r.stderr


@pytest.fixture(scope="module")
def clean_two_ranks(tmp_path_factory, corpus):
    """The uninterrupted 2-rank run both elastic restarts are held to, trained once: saving
    in the background or not leaves the losses bit for bit the same (as
    test_background_saves_hold_the_state_of_their_step shows in one process)."""
    clean = tmp_path_factory.mktemp("clean") / "run"
    over = {**COMMON, "checkpoint.interval": 4}
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(clean, corpus, **over)))
    assert r.returncode == 0, r.stderr[-3000:]
    return clean


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, background",
    [("kill:rank=1:step=6", False), ("kill:rank=1:save=8", True)],
    ids=["mid-run", "mid-async-save"],
)
def test_elastic_restart_resumes_exactly(fault, background, clean_two_ranks, tmp_path, corpus):
    """2 ranks under the elastic agent: a rank SIGKILLed after step 6 (or while the
    background save of step 8 is being written) is restarted with its peer, resumes from
    the last complete checkpoint and reproduces the uninterrupted run bit for bit."""
    over = {**COMMON, "checkpoint.interval": 4, "checkpoint.async": background}
    clean = clean_two_ranks
    d = tmp_path / "faulty"
    r = run_cli(
        "train",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        *cli_args(tiny_overrides(d, corpus, **over)),
        env={"MESHFORGE_FAULT": fault},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(d) == losses(clean)
    ev = events(d)
    assert any(e["event"] == "restart" and e["attempt"] == 1 for e in ev)
    resumed = [e for e in ev if e["event"] == "resumed"]
    assert resumed[0]["step"] == 4  # step 8's save never completed (mid-save) or was not reached
    assert [c.step for c in store.list_complete(d / "checkpoints")] == [4, 8, 12]
    assert not list((d / "checkpoints").glob(".tmp-*"))


# ----------------------------------------------------------------------------- resharding

RESHARD = {  # name: (saving ranks, saving layout, loading ranks, loading layout)
    "dp4-zero3->dp2-ddp": (4, {"parallel.zero_stage": 3}, 2, {"parallel.zero_stage": 0}),
    "dp2-ddp->tp2": (2, {"parallel.zero_stage": 0}, 2, {"parallel.tp": 2}),
    "dp2-zero1->single": (2, {"parallel.zero_stage": 1}, 1, {}),
    "dp2-zero3->pp2": (2, {"parallel.zero_stage": 3}, 2, {"parallel.pp": 2}),
    "pp2-gpipe->dp2-zero2": (2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}, 2, {"parallel.zero_stage": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESHARD))
def test_resume_on_another_layout(name, reference, tmp_path, corpus):
    """Save at step 6 under one layout, continue in a new run on another: the same data
    order (the sampler counts global samples) and the uninterrupted losses to 1e-5."""
    n_save, save_layout, n_load, load_layout = RESHARD[name]
    first = tmp_path / "first"
    over = {**COMMON, "train.steps": 6, "checkpoint.interval": 6, "optim.decay_steps": STEPS}
    r = run_cli("train", "--nproc", str(n_save), *cli_args(tiny_overrides(first, corpus, **over, **save_layout)))
    assert r.returncode == 0, r.stderr[-3000:]
    second = tmp_path / "second"
    over = {**COMMON, "checkpoint.load": str(first / "checkpoints")}
    r = run_cli("train", "--nproc", str(n_load), *cli_args(tiny_overrides(second, corpus, **over, **load_layout)))
    assert r.returncode == 0, r.stderr[-3000:]
    ref = losses(reference)
    got = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert [g["step"] for g in got] == list(range(7, STEPS + 1))
    assert [g["loss"] for g in got] == pytest.approx(ref[6:], rel=1e-5)
    resumed = [e for e in events(second) if e["event"] == "resumed"][0]
    assert resumed["resharded"] == (n_save != n_load or save_layout != load_layout)
    assert_same_weights(reference, second)


# ----------------------------------------------------------------------------- cadence, export


def test_young_daly_interval():
    steps, seconds = young_daly_steps(blocking_s=2.0, mtbf_hours=2.0, step_time_s=1.0)
    assert seconds == pytest.approx((2 * 2.0 * 7200) ** 0.5) and steps == round(seconds)
    assert young_daly_steps(1e-9, 1.0, 10.0)[0] == 1


def test_auto_interval_is_logged_with_its_inputs(tmp_path, corpus):
    d = tmp_path / "run"
    train(tiny_config(d, corpus, **COMMON, **{"checkpoint.interval": "auto", "checkpoint.mtbf_hours": 1e-4}))
    chosen = [e for e in events(d) if e["event"] == "checkpoint_interval"]
    assert chosen and {"steps", "seconds", "blocking_s", "mtbf_hours", "step_time_s"} <= chosen[0].keys()
    assert chosen[0]["mtbf_hours"] == 1e-4 and chosen[0]["steps"] >= 1
    assert store.list_complete(d / "checkpoints")[-1].step == STEPS
    with pytest.raises(ConfigError, match=r"checkpoint.interval = 'often'"):
        from meshforge.resolve import resolve

        resolve(load_config(None, {"checkpoint.interval": "often"}))


def test_convert_checkpoint_to_hf(saved, tmp_path):
    out = tmp_path / "hf"
    r = run_cli("convert", "--from-checkpoint", str(saved / "checkpoints"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step-00000012" in r.stdout
    hf = load_hf_checkpoint(out).state_dict()
    final = load_weights(saved / "final").state_dict()
    for k, v in final.items():
        torch.testing.assert_close(hf[k], v, rtol=0, atol=0, msg=k)


def test_no_loadable_checkpoint_is_an_error_not_a_silent_restart(saved, tmp_path):
    run = copy_run(saved, tmp_path / "run")
    for c in store.list_complete(run / "checkpoints"):
        (c.path / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be loaded: .*step-00000012/__0_0.distcp"):
        checkpoint_to_load("latest", run / "checkpoints", lambda *a, **k: None)
