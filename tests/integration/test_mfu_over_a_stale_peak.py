"""MFU on a CPU whose cached peak is wrong: a run that computes faster than its cached peak says
so, takes the estimate instead, and never reports MFU or HFU over 100%."""

import json

from conftest import cached_cpu_peak, tiny_config, train
from meshforge.metrics import cpu_peak


def test_a_run_that_beats_its_cached_peak_says_so_and_never_reports_over_100_percent(monkeypatch, tmp_path, corpus):
    """A peak cached while the cores were busy (here 1 MFLOP/s, and measuring again gives no
    better): the run takes the estimate instead, says so, and no record shows MFU > 100%."""
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_peak, "calibrate_cpu_peak", lambda dtype: 1e6)
    cached_cpu_peak(tmp_path, flops=1e6)
    run = tmp_path / "run"
    summary = train(tiny_config(run, corpus, **{"train.steps": 3, "train.eval_batches": 0}))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(0 < r["mfu"] <= 1 and 0 < r["hfu"] <= 1 for r in rows)
    assert 0 < summary["mfu"] <= 1
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    said = [e for e in ev if e["event"] == "peak_flops"]
    assert said and said[0]["old"] == 1e6 and said[0]["source"] == "estimate" and said[0]["new"] >= said[0]["reached"]
