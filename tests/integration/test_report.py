"""The HTML run report: built from real runs (finished, crashed, pipelined), parsed back."""

import json
import shutil
from html.parser import HTMLParser

import pytest

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.cli.main import main
from meshforge.report import write_report
from meshforge.report.run_report import CHARTS, load_run, predict


class Page(HTMLParser):
    """The parts of a report a test looks at: charts (from the page's JSON specs) and their
    series, the pipeline timeline's rects, the text."""

    def __init__(self, text: str):
        super().__init__()
        self.charts: dict[str, list[str]] = {}  # data-metric -> series labels
        self.panels: list[str] = []  # chart containers, in order
        self.specs: list[dict] = []
        self.kinds: list[str] = []  # pipeline action kinds
        self.text: list[str] = []
        self._data = False
        self._script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self._data, self._script = a.get("id") == "report-data", True
        elif "data-metric" in a:
            self.panels.append(a["data-metric"])
            self.charts.setdefault(a["data-metric"], [])
        if tag == "rect" and a.get("class") == "action":
            self.kinds.append(a["data-kind"])

    def handle_endtag(self, tag):
        if tag == "script":
            self._data = self._script = False

    def handle_data(self, data):
        if self._data:
            self.specs = json.loads(data)
            self.charts.update({c["metric"]: [s["label"] for s in c["series"]] for c in self.specs})
        elif not self._script:
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
    assert "<script src" not in raw and "<link" not in raw  # uPlot is inlined: works offline, from file://
    assert "http://" not in raw.replace("http://www.w3.org/2000/svg", "")
    assert {"loss", *(k for k, _, _ in CHARTS)} <= set(page.charts) and set(page.panels) == set(page.charts)
    assert "comm_bytes" not in page.charts  # one process: no communication, so no panel
    for key, _, _ in CHARTS:
        assert len(page.charts[key]) == 1, key
    loss = next(c for c in page.specs if c["metric"] == "loss")
    assert loss["data"][0][:3] == [1, 2, 3] and [s["dashed"] for s in loss["series"]] == [False, True]
    assert next(c for c in page.specs if c["metric"] == "mfu")["unit"] == "%"
    assert "Where the wall time went" in page.all_text and "compute" in page.all_text
    assert page.charts["loss"] == ["run<b>& loss", "run<b>& val loss"]
    text = page.all_text
    last = _metrics(finished)[-1]["loss"]
    assert f"{last:.4f}" in text
    assert "[model]" in text and "hidden = 64" in text  # the resolved config
    for kind in ("run_start", "eval", "run_end"):
        assert kind in text
    end = json.loads((finished / "summary.json").read_text())
    assert f"mfu {100 * end['mfu']:.2f}%" in text  # events speak MFU in %, as the overview and the chart do
    assert "finished" in text and "1 x this-cpu" in text  # the planner ran for this layout, on this CPU
    # the planner's step, term by term: the parts add up to the predicted step time it names
    pred = predict(load_run(finished))
    assert "Where the planner says a step goes" in text and "model FLOPs at peak" in text
    assert f"{pred['step_time_s']:,.4f} s per step predicted" in text
    assert sum(pred["budget"].values()) == pytest.approx(1.0, abs=1e-6)


def test_a_refused_run_leaves_the_old_runs_report_alone(finished, corpus, capsys):
    """The CLI writes the report after train() returns; a run refused before it starts
    (run.dir holds another run, and checkpoint.load = none would not continue it) must not
    rewrite that run's report."""
    before = (finished / "report.html").stat().st_mtime_ns
    over = tiny_overrides(finished, corpus, **{"train.steps": 2, "checkpoint.load": "none"})
    assert main(["train", *cli_args(over)]) == 2
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


CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")
BROWSER_JS = """
const out = {};
for (const el of document.querySelectorAll('.chart[data-metric]')) {
  if (!el.uplot) continue;
  const u = el.uplot;
  u.setCursor({left: u.bbox.width / devicePixelRatio - 2, top: 10});  // hover the last step
  out[el.dataset.metric] = {
    xticks: el.dataset.xticks, yticks: el.dataset.yticks,
    grid: u.axes.map(a => a.grid.show),
    legend: [...el.querySelectorAll('.u-series')].map(s => [
      s.querySelector('.u-label').textContent, s.querySelector('.u-value').textContent,
      s.querySelector('.u-marker') ? getComputedStyle(s.querySelector('.u-marker')).borderTopStyle : null]),
  };
}
out.format = [hoverFmt('tok/s', 16012.4), hoverFmt('%', 0.2255), axisFmt('%', [0.2, 0.25], 0.05)];
return out;
"""


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None, reason="no Chromium + chromedriver (apt-get install chromium chromium-driver)"
)
def test_report_in_chromium_has_ticks_legends_and_units(finished):
    """The real run's report from file:// in headless Chromium: every chart drawn with tick
    labels and grid on both axes, a legend entry per series (val loss dashed), hover values in
    the chart's unit."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    try:
        driver.get((finished / "report.html").resolve().as_uri())
        assert driver.execute_script("return document.body.dataset.charts") == "drawn"
        got = driver.execute_script(BROWSER_JS)
    finally:
        driver.quit()
    assert got.pop("format") == ["16,012 tok/s", "22.55%", ["20%", "25%"]]
    assert {"loss", "lr", "mfu", "tokens_per_s", "peak_mem_gib"} <= set(got) and "comm_bytes" not in got
    for metric, c in got.items():
        assert len(c["xticks"].split("|")) >= 3 and len(c["yticks"].split("|")) >= 2, (metric, c)
        assert c["grid"] == [True, True], metric
        assert c["legend"][0][0] == "step" and c["legend"][0][1] == "12", (metric, c["legend"])  # hovered
    assert all(t.endswith("%") for t in got["mfu"]["yticks"].split("|"))
    assert all(t.endswith(" GiB") for t in got["peak_mem_gib"]["yticks"].split("|"))
    assert got["mfu"]["legend"][1][1].endswith("%") and got["tokens_per_s"]["legend"][1][1].endswith(" tok/s")
    (_, loss, solid), (_, val, dashed) = got["loss"]["legend"][1:]
    assert [solid, dashed] == ["solid", "dashed"] and loss != "--" and val != "--"
