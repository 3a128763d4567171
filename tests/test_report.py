"""The HTML run report: built from real runs (finished, crashed, pipelined), parsed back."""

import json
import shutil
from html.parser import HTMLParser

import pytest

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.cli import main
from meshforge.report import write_report
from meshforge.report.run_report import CHARTS


class Page(HTMLParser):
    """The parts of a report a test looks at: charts and their series, timeline rects, text."""

    def __init__(self, text: str):
        super().__init__()
        self.charts: dict[str, list[str]] = {}  # data-metric -> series labels
        self.kinds: list[str] = []  # pipeline action kinds
        self.text: list[str] = []
        self._chart: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "data-metric" in a:
            self._chart = a["data-metric"]
            self.charts[self._chart] = []
        elif tag == "polyline" and self._chart:
            self.charts[self._chart].append(a["data-label"])
        elif tag == "rect" and a.get("class") == "action":
            self.kinds.append(a["data-kind"])

    def handle_endtag(self, tag):
        if tag == "svg":
            self._chart = None

    def handle_data(self, data):
        self.text.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A 12-step run with evaluations at steps 4 and 8 (and the end); its dir name needs escaping."""
    run = tmp_path_factory.mktemp("rep") / "run<b>&"
    assert main(["train", *cli_args(tiny_overrides(run, corpus, **{"train.steps": 12, "train.eval_interval": 4}))]) == 0
    return run


def test_a_finished_run_writes_its_report(finished):
    raw = (finished / "report.html").read_text()
    page = Page(raw)
    assert "<b>&" not in raw and "run&lt;b&gt;&amp;" in raw  # every string escaped
    assert "<script src" not in raw and "http://" not in raw.replace("http://www.w3.org/2000/svg", "")
    assert {"loss", *(k for k, _ in CHARTS)} <= set(page.charts)
    assert "communication bytes" in page.all_text  # one process: no communication, the chart says so
    for key, _ in CHARTS:
        assert len(page.charts[key]) == 1, key
    assert page.charts["loss"] == ["run<b>& loss", "run<b>& val loss"]
    text = page.all_text
    last = _metrics(finished)[-1]["loss"]
    assert f"{last:.4f}" in text
    assert "[model]" in text and "hidden = 64" in text  # the resolved config
    for kind in ("run_start", "eval", "run_end"):
        assert kind in text
    assert "finished" in text and "1 x cpu" in text  # the planner ran for this layout


def test_a_refused_run_leaves_the_old_runs_report_alone(finished, corpus, capsys):
    """The CLI writes the report after train() returns; a run refused before it starts
    (run.dir holds another run) must not rewrite that run's report."""
    before = (finished / "report.html").stat().st_mtime_ns
    assert main(["train", *cli_args(tiny_overrides(finished, corpus, **{"train.steps": 2}))]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (finished / "report.html").stat().st_mtime_ns == before


def test_two_runs_overlay_and_a_crashed_run_renders(finished, tmp_path, corpus):
    crashed = tmp_path / "crashed"
    r = run_cli(
        "train",
        *cli_args(tiny_overrides(crashed, corpus, **{"train.steps": 8})),
        env={"MESHFORGE_FAULT": "kill:rank=0:step=3"},
    )
    assert r.returncode != 0 and not (crashed / "report.html").exists()  # killed: no finally ran
    out = tmp_path / "both.html"
    assert main(["report", str(finished), str(crashed), "--out", str(out)]) == 0
    page = Page(out.read_text())
    assert len(page.charts["lr"]) == 2 and len(page.charts["mfu"]) == 2
    assert "incomplete" in page.all_text
    # a torn metrics line and no summary: still a report from what is there
    torn = tmp_path / "torn"
    shutil.copytree(finished, torn)
    (torn / "summary.json").unlink()
    text = (torn / "metrics.jsonl").read_text()
    (torn / "metrics.jsonl").write_text(text[: len(text) - 40])
    page = Page(write_report([torn]).read_text())
    assert len(page.charts["loss"]) == 2 and "grad_norm" in page.charts


def test_not_a_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "not a meshforge run directory" in err


def test_no_report_when_turned_off(tmp_path, corpus):
    run = tmp_path / "run"
    o = tiny_overrides(run, corpus, **{"train.steps": 2, "metrics.report": False, "train.eval_batches": 0})
    assert main(["train", *cli_args(o)]) == 0
    assert (run / "metrics.jsonl").is_file() and not (run / "report.html").exists()


def test_pipeline_run_report_has_the_timeline(tmp_path, corpus):
    run = tmp_path / "pp"
    o = tiny_overrides(run, corpus, **{"train.steps": 4, "parallel.pp": 2, "train.eval_batches": 0})
    r = run_cli("train", "--nproc", "2", *cli_args(o))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / "pipeline_gantt.png").exists()  # the report's timeline replaces the PNG
    page = Page((run / "report.html").read_text())
    assert {"F", "B"} <= set(page.kinds)
    assert "pipeline_timeline" in page.charts
    assert "measured bubble" in (run / "report.html").read_text()  # the schedule and bubble, from the event
    assert page.charts["comm_bytes"]  # bytes per mesh axis, e.g. the pp sends
