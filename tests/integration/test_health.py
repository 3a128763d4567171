"""Run health: injected faults (MESHFORGE_FAULT) are caught, named and acted on, on 2 gloo ranks.

Each 2-rank run is shared by several assertions (module-scoped fixtures) to keep the suite short.
"""

import json
import math

import pytest
import torch

from conftest import cli_args, rank_plan, run_cli, tiny_config, tiny_overrides
from meshforge.checkpoint.weights import load_weights
from meshforge.errors import ConfigError
from meshforge.health.faults import parse
from meshforge.health.spike import SpikeDetector
from meshforge.parallel.mesh import build_mesh
from meshforge.train.loop import Trainer, agree_on_start

STEPS = 8
COMMON = {"train.steps": STEPS, "optim.warmup_steps": 0}


def events(d, kind=None):
    out = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    return [e for e in out if kind is None or e["event"] == kind]


def train_2(d, corpus, fault, extra=None, args=()):
    r = run_cli(
        "train",
        "--nproc",
        "2",
        *args,
        *cli_args(tiny_overrides(d, corpus, **COMMON, **(extra or {}))),
        env={"MESHFORGE_FAULT": fault},
        timeout=240,
    )
    return r


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory, corpus):
    """NaN in one gradient of rank 1 at step 5 (skip), rank 1's forward 4x slower, and a loss
    spike at step 7 (log), which is not a logged step: its loss is reduced asynchronously and
    judged at step 8."""
    d = tmp_path_factory.mktemp("skip") / "run"
    extra = {"metrics.console": True, "metrics.log_interval": 4, "health.spike_threshold": 6.0}
    r = train_2(d, corpus, "nan:rank=1:step=5,slow:rank=1:factor=4,spike:step=7", extra)
    assert r.returncode == 0, r.stderr[-4000:]
    return d, r.stdout


def reference_weights(tmp_path, corpus, skip: int | None):
    """One process, the same weights and data, stepping by hand; step ``skip``'s batch is
    consumed (data order, step count, LR schedule advance) without an update."""
    plan = rank_plan(tiny_config(tmp_path / f"ref-{skip}", corpus, **COMMON))
    mesh = build_mesh(plan.layout, "cpu")
    plan, _ = agree_on_start(plan, mesh)
    tr = Trainer(plan, mesh)
    batches = {}  # step -> its global batch's sample indices
    for n in range(1, STEPS + 1):
        batches[n] = tr.state.sampler.indices(tr.state.sampler.consumed, tr.state.sampler.batch).tolist()
        if n == skip:
            tr.state.sampler.next_batch()
            tr.state.advance()
            tr.scheduler.step()
        else:
            tr.step_once(measure=False)
    tr.log.close()
    names = [n for n, _ in tr.model.named_parameters()]
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}, names, batches


def max_rel_err(a: dict, b: dict) -> float:
    return max(float((b[k] - a[k]).norm() / a[k].norm()) for k in a)


@pytest.mark.slow
def test_nonfinite_skip_equals_a_run_that_skipped_the_batch(skip_run, tmp_path, corpus):
    d, stdout = skip_run
    got = load_weights(d / "final").state_dict()
    assert all(torch.isfinite(v).all() for v in got.values())
    ref, names, batches = reference_weights(tmp_path, corpus, skip=5)
    assert max_rel_err(ref, got) < 1e-5  # the logged spike changed nothing
    unskipped, _, _ = reference_weights(tmp_path, corpus, skip=None)
    assert max_rel_err(unskipped, got) > 1e-3  # the skip mattered: the test can fail
    (ev,) = events(d, "nonfinite")
    assert ev["step"] == 5 and ev["ranks"] == [1] and ev["action"] == "skip"  # rank 1's loss started it
    assert ev["where"] == ["loss", "grad_norm"] and ev["loss_ranks"] == [1] and ev["grad_ranks"] == [0, 1]
    assert ev["param"] == names[0] and ev["param_rank"] == 0  # the reduction spread it to every rank
    assert "warning: non-finite loss and grad_norm at step 5 on rank(s) [1]" in stdout
    assert math.isfinite(json.loads((d / "summary.json").read_text())["final_loss"])  # the skipped loss is left out
    (spike,) = events(d, "loss_spike")  # judged one step late, but named with its own step and batch
    assert spike["step"] == 7 and spike["action"] == "log" and spike["score"] > 6
    assert spike["samples"] == batches[7] != batches[8]
    assert "warning: loss spike at step 7" in stdout


@pytest.mark.slow
def test_nonfinite_under_pp_is_caught_on_the_stage_that_runs_it(tmp_path, corpus):
    """Under pp the model object is a view that forward never calls: the fault and the
    timing hooks sit on the stages' parts. Every rank skips step 3, with no collective of
    the guard's own (the stage group reduces the gradient norm)."""
    d = tmp_path / "run"
    r = train_2(d, corpus, "nan:rank=1:step=3,slow:rank=1:factor=4", {"parallel.pp": 2})
    assert r.returncode == 0, r.stderr[-4000:]
    (ev,) = events(d, "nonfinite")
    assert ev["step"] == 3 and ev["ranks"] == [1] and ev["grad_ranks"] == [0, 1] and ev["action"] == "skip"
    assert {e["rank"] for e in events(d, "straggler")} == {1}
    assert math.isfinite(json.loads((d / "summary.json").read_text())["final_loss"])


@pytest.mark.slow
def test_slow_rank_is_named_as_a_straggler(skip_run):
    d, stdout = skip_run
    slow = events(d, "straggler")
    assert slow and {e["rank"] for e in slow} == {1}  # rank 0 waits for it, but is not named
    assert slow[0]["ratio"] > 1.5 and slow[0]["host"]  # health.straggler_factor
    assert "warning: straggler: rank 1" in stdout


@pytest.mark.slow
def test_rollback_resumes_from_the_checkpoint_and_finishes(tmp_path, corpus):
    """A NaN at step 6 and a loss spike at step 8, both with rollback: each goes back to the
    checkpoint of step 4 and skips the batches since; the run still ends at step 8."""
    d = tmp_path / "run"
    extra = {"health.on_nonfinite": "rollback", "checkpoint.interval": 4}
    extra.update({"health.spike_threshold": 6.0, "health.on_spike": "rollback"})
    r = train_2(d, corpus, "nan:rank=1:step=6,spike:step=8", extra)
    assert r.returncode == 0, r.stderr[-4000:]
    (bad,) = events(d, "nonfinite")
    assert bad["step"] == 6 and bad["action"] == "rollback"
    (spike,) = events(d, "loss_spike")
    assert spike["step"] == 8 and spike["action"] == "rollback" and spike["score"] > 6
    assert len(spike["samples"]) == 8 and spike["loss"] > 10 * spike["median"]
    back = [(e["bad_step"], e["to_step"], e["batches_skipped"]) for e in events(d, "rollback")]
    assert back == [(6, 4, 2), (8, 4, 6)]
    assert json.loads((d / "summary.json").read_text())["steps"] == STEPS
    steps = [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # the rolled-back records were dropped, then redone
    assert all(torch.isfinite(v).all() for v in load_weights(d / "final").state_dict().values())


def test_fault_specs_parse_and_refuse():
    assert parse("nan:rank=1:step=5") == ("nan", {"rank": 1, "step": 5})
    assert parse("slow:rank=0:factor=2.5") == ("slow", {"rank": 0, "factor": 2.5})
    for bad in ("nan:rank=1", "spike:rank=1", "hang:rank=x:step=2", "boom:step=1"):
        with pytest.raises(ConfigError, match="hang:rank=R:step=S"):
            parse(bad)


def test_spike_detector_is_robust():
    det = SpikeDetector(threshold=6.0, window=20)
    losses = [3.0 - 0.01 * i + (0.02 if i % 2 else -0.02) for i in range(20)]
    assert all(det.check(x) is None for x in losses)
    assert det.check(3.0) is None  # within the noise
    assert det.check(9.0) is not None  # a spike, kept out of the window
    assert det.check(2.8) is None and math.isclose(det.median(), sorted(det.losses)[len(det.losses) // 2], rel_tol=0.1)


def test_rollback_needs_checkpoints(tmp_path, corpus):
    with pytest.raises(ConfigError, match="health.on_spike = 'rollback' needs checkpoints.*checkpoint.interval"):
        tiny_config(tmp_path, corpus, **{"health.on_spike": "rollback"})


@pytest.mark.slow
def test_hang_is_reported_naming_the_rank_then_restarted(tmp_path, corpus):
    """Rank 1 stops before step 5's work; the watchdog names it and the collective rank 0
    waits in, then the ranks exit and the elastic agent restarts them from step 4."""
    d = tmp_path / "run"
    timeout = 5.0
    extra = {"checkpoint.interval": 2, "health.hang_timeout_s": timeout}
    r = train_2(d, corpus, "hang:rank=1:step=5", extra, args=("--max-restarts", "1"))
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads((d / "hang_report.json").read_text())
    assert report["lagging_ranks"] == [1] and report["waiting_ranks"] == [0]
    assert report["collective"] and report["axis"] == "dp_shard" and report["step"] == 5
    (hang,) = events(d, "hang")
    assert hang["lagging_ranks"] == [1] and hang["collective"] == report["collective"]
    saved_4 = next(e for e in events(d, "checkpoint_saved") if e["step"] == 4)
    assert hang["time"] - saved_4["time"] < timeout + 15
    assert [e["step"] for e in events(d, "resumed")] == [4]
    assert "lagging rank(s) [1]" in r.stderr
    assert json.loads((d / "summary.json").read_text())["steps"] == STEPS


def test_hang_report_names_the_rank_behind_or_silent():
    from meshforge.health.hang_report import build_report

    def post(step, entered, completed, op="all_reduce"):
        last = {"entered": entered, "completed": completed, "op": op}
        return {"step": step, "host": "h", "collectives": {"dp": last}}

    rep = build_report({0: post(5, 9, 8), 1: post(5, 8, 8, "broadcast"), 2: post(5, 9, 8)}, world=4)
    assert rep["lagging_ranks"] == [1, 3] and rep["silent_ranks"] == [3]
    assert (rep["collective"], rep["axis"], rep["seq"], rep["waiting_ranks"]) == ("all_reduce", "dp", 9, [0, 2])
    same = build_report({0: post(6, 9, 8), 1: post(5, 9, 8)}, world=2)  # nobody behind in order: oldest step
    assert same["lagging_ranks"] == [1] and same["collective"] is None


def test_binary_data_is_named_and_skipped_checkpoints_are_said(tmp_path, capsys):
    from meshforge.health.text_check import not_text_files
    from meshforge.train.run_dir import event_writer

    (tmp_path / "prose.txt").write_text("plain text, ünïcödé too\n" * 100)
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 64)
    ((path, share),) = not_text_files(str(tmp_path), 0.05)
    assert path.name == "blob.txt" and 0.3 < share < 0.7
    assert not_text_files(str(tmp_path / "prose.txt"), 0.05) == []
    cfg = tiny_config(tmp_path, tmp_path)
    event_writer(cfg.run.dir)("checkpoint_skipped", path="ckpt/step-8", reason="shard hash does not match")
    assert "warning: skipped checkpoint ckpt/step-8 (shard hash does not match)" in capsys.readouterr().err


@pytest.mark.parametrize("over", [{"health.on_nonfinite": "stop"}, {"health.max_skipped": 0}], ids=["stop", "max"])
def test_stop_and_max_skipped_end_the_run_naming_the_step(over, tmp_path, corpus, monkeypatch):
    from conftest import train
    from meshforge.health import faults
    from meshforge.health.keeper import HealthStop

    monkeypatch.setenv("MESHFORGE_FAULT", "nan:rank=0:step=2")
    monkeypatch.setattr(faults, "_fired", set())
    cfg = tiny_config(tmp_path / "run", corpus, **{"train.steps": 4, "train.eval_batches": 0, **over})
    with pytest.raises(HealthStop, match="non-finite loss and grad_norm at step 2 on rank.s. .0."):
        train(cfg)
    (ev,) = events(tmp_path / "run", "nonfinite")
    assert ev["action"] == "stop" and ev["step"] == 2
