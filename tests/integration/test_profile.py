"""[profile] traces, the pipeline timeline as Chrome trace events, and the time breakdown,
from one 2-rank pipeline run."""

import json

import pytest

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.metrics.time_breakdown import PARTS


@pytest.fixture(scope="module")
def traced(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("traced") / "run"
    over = {"train.steps": 6, "metrics.log_interval": 3, "profile.start_step": 2, "profile.steps": 2}
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(d, corpus, **over, **{"parallel.pp": 2})))
    assert r.returncode == 0, r.stderr[-4000:]
    return d


@pytest.mark.slow
def test_profile_writes_a_loadable_trace_per_rank(traced):
    for rank in (0, 1):
        trace = json.loads((traced / "profile" / f"rank-{rank:05d}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"meshforge step 2", "meshforge step 3"} <= names  # the traced steps are marked
        assert any("aten::" in n for n in names)
    (ev,) = [json.loads(x) for x in (traced / "events.jsonl").read_text().splitlines() if '"profile"' in x]
    assert ev["first"] == 2 and ev["last"] == 3
    timeline = json.loads(next((traced / "profile").glob("pipeline-step-*.json")).read_text())
    spans = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1} and {e["cat"] for e in spans} >= {"forward", "backward"}
    assert all(e["dur"] >= 0 for e in spans)


@pytest.mark.slow
def test_time_breakdown_is_logged_per_rank_and_summed(traced):
    recs = [json.loads(x) for x in (traced / "metrics.jsonl").read_text().splitlines()]
    for rec in recs:
        tb = rec["time_breakdown"]
        assert len(tb["by_rank"]) == 2 and all(len(r) == len(PARTS) and min(r) >= 0 for r in tb["by_rank"])
        assert tb["compute_s"] > 0 and tb["bubble_s"] > 0  # a pipeline with 2 stages idles
        assert "exposed_comm_pp_s" not in tb  # a stage's point-to-point waits are the bubble's, counted once
    summary = json.loads((traced / "summary.json").read_text())
    tb = summary["time_breakdown"]  # the whole wall time: steps split as measured, phases, the rest
    assert tb["wall_s"] == pytest.approx(summary["wall_time_s"], abs=1e-3)
    axes = [k for k in tb if k.startswith("exposed_comm_") and k != "exposed_comm_s"]  # its split by axis
    assert "exposed_comm_pp_s" not in axes and sum(tb[k] for k in axes) == pytest.approx(tb["exposed_comm_s"], abs=1e-5)
    parts = [k for k in tb if k != "wall_s" and k not in axes]
    assert {"compute_s", "bubble_s", "data_s", "checkpoint_s", "eval_s", "logging_s", "other_s"} <= set(parts)
    assert sum(tb[k] for k in parts) == pytest.approx(tb["wall_s"], rel=1e-3) and min(tb[k] for k in parts) >= 0
    assert tb["compute_s"] > 0 and tb["bubble_s"] > 0


def test_memory_history_follows_profile_memory(tmp_path, monkeypatch):
    """profile.memory = false leaves CUDA's allocation recording off in the traced steps (the GPU
    suite's kernel diff compares their host side with the peer's, which records none)."""
    import torch

    from meshforge.config.sections import ProfileConfig
    from meshforge.metrics.profiler import StepProfiler

    recorded = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: recorded.append(a or k))

    class NoTrace:
        def __init__(self, **_kw):
            pass

        def __enter__(self):
            return self

    monkeypatch.setattr("meshforge.metrics.profiler.profile", NoTrace)
    for memory in (False, True):
        p = StepProfiler(ProfileConfig(steps=1, memory=memory), 0, torch.device("cuda"), tmp_path, 10)
        p._start()
    assert len(recorded) == 1  # only the profiler built with memory = true started a recording
    assert not StepProfiler(ProfileConfig(steps=1), 0, torch.device("cpu"), tmp_path, 10).memory
