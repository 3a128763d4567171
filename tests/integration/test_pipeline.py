"""Pipeline parallelism reproduces the single-process run (fp32, gloo, CPU): every schedule
at pp = 2, 1F1B and interleaved 1F1B at pp = 4, and pp composed with FSDP, with tensor
parallelism, and both (8 ranks). Each layout trains 3 steps of 16 sequences with active
clipping; losses, gradient norms, validation loss and the gathered final weights must match
the single-process reference to 1e-5 relative (weights per tensor by norm, as in
test_data_parallel). Also: the stage split, the bubble and in-flight bookkeeping, the Gantt
chart, and bad pipeline settings.
"""

import json

import pytest
import torch

from conftest import (
    assert_run_matches,
    cli_args,
    layout_runner,
    run_cli,
    tiny_config,
    tiny_overrides,
    train,
)
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models.loss import drain_aux, report_aux
from meshforge.parallel.pipeline.runtime import Action, Timeline
from meshforge.parallel.pipeline.schedules import bubble_fraction
from meshforge.parallel.pipeline.split import balanced_split, chunk_ranks
from meshforge.parallel.pipeline.stage_aux import StageAux
from meshforge.resolve import resolve

STEPS = 3
COMMON = {
    "model.hidden": 64,
    "model.heads": 4,
    "model.kv_heads": 2,
    "model.ffn_hidden": 128,
    "model.layers": 8,
    "train.steps": STEPS,
    "train.global_batch_size": 16,
    "train.grad_clip": 0.5,
    "train.eval_batches": 1,
    "optim.lr": 1e-3,
}


def sched(pp: int, name: str, v: int = 1, **more) -> dict:
    return {"parallel.pp": pp, "parallel.pp_schedule": name, "parallel.pp_virtual_stages": v, **more}


LAYOUTS = {  # name: (ranks, overrides)
    "pp2-gpipe": (2, sched(2, "gpipe")),
    "pp2-1f1b": (2, sched(2, "1f1b")),
    "pp2-interleaved": (2, sched(2, "interleaved_1f1b", 2)),
    "pp2-zero_bubble": (2, sched(2, "zero_bubble", 2)),
    "pp2-zbv": (2, sched(2, "zbv", 2)),
    "pp2-dualpipev": (2, sched(2, "dualpipev", 2)),
    # Llama 3's balancing: the first chunk holds only the embedding, the last only the head
    "pp2-interleaved-ends": (2, sched(2, "interleaved_1f1b", 2, **{"parallel.pp_layers": [0, 4, 4, 0]})),
    "pp4-1f1b": (4, sched(4, "1f1b", **{"parallel.num_microbatches": 8})),
    "pp4-interleaved": (4, sched(4, "interleaved_1f1b", 2)),
    "pp2-dp_shard2": (4, sched(2, "1f1b", **{"parallel.dp_shard": 2, "parallel.zero_stage": 3})),
    "pp2-tp2": (4, sched(2, "1f1b", **{"parallel.tp": 2})),
    "dp_shard2-tp2-pp2": (8, sched(2, "1f1b", **{"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 3})),
}


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("ref") / "run"
    train(tiny_config(d, corpus, **COMMON, **{"train.micro_batch_size": 2}))
    return d


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, corpus):
    return layout_runner(tmp_path_factory, corpus, LAYOUTS, COMMON)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, layout_runs):
    assert_run_matches(reference, layout_runs(name), STEPS)
    # activations and gradients crossed the pp axis
    assert all(g["comm_bytes"]["pp"] > 0 for g in metrics(layout_runs(name)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, schedule, p, m, v",
    [("pp2-gpipe", "gpipe", 2, 4, 1), ("pp2-1f1b", "1f1b", 2, 4, 1), ("pp4-1f1b", "1f1b", 4, 8, 1)],
)
def test_bubble_and_in_flight_are_logged(name, schedule, p, m, v, layout_runs):
    """The measured bubble is logged next to the formula, and the first stage holds the
    activations of m micro-batches under GPipe but only p under 1F1B."""
    for rec in metrics(layout_runs(name)):
        assert rec["bubble_theory"] == pytest.approx(bubble_fraction(schedule, p, m, v))
        assert 0.0 <= rec["bubble_fraction"] < 1.0
        assert len(rec["pp_in_flight"]) == p
        assert rec["pp_in_flight"][0] == (m if schedule == "gpipe" else min(m, p))
        assert rec["pp_in_flight"][-1] == (m if schedule == "gpipe" else 1)


@pytest.mark.slow
def test_gantt_chart_of_a_step(layout_runs):
    run = layout_runs("pp2-zero_bubble")
    assert not (run / "pipeline_gantt.png").exists()  # the run report draws the timeline instead
    rows = json.loads((run / "pipeline_timeline.json").read_text())
    assert len(rows) == 2
    for row in rows:
        kinds = {a["kind"] for a in row["actions"]}
        assert kinds == {"F", "B", "W"}  # zero-bubble splits the weight gradient out
        per_chunk = {}
        for a in row["actions"]:
            per_chunk.setdefault((a["kind"], a["chunk"]), set()).add(a["microbatch"])
        # every micro-batch through every chunk; automatic m: the largest divisor of the
        # per-rank batch (16) up to 2 x pp x v = 8
        assert all(mbs == set(range(8)) for mbs in per_chunk.values())
        assert all(0 <= a["start"] <= a["end"] <= row["span"] + 1e-6 for a in row["actions"])
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    gantt = next(e for e in events if e["event"] == "pipeline_gantt")
    assert gantt["path"].endswith("pipeline_timeline.json") and gantt["schedule"] == "zero_bubble"
    assert gantt["microbatches"] == 8 and 0 <= gantt["bubble"] < 1


# ----------------------------------------------------------------------------- pieces


def test_split_balances_cost_and_counts_the_head():
    args = load_config(None, {"model.preset": "llama3.1-8b"}).shape
    sizes = balanced_split(args, 8192, 4)
    assert sum(sizes) == 32 and min(sizes) >= 1
    assert sizes[-1] < sizes[1]  # the last stage also carries the 128k-vocabulary head
    assert sizes[0] <= sizes[1]  # the first carries the embedding
    small_vocab = load_config(None, {"model.preset": "debug"}).shape
    assert balanced_split(small_vocab, 256, 2) == [small_vocab.layers // 2] * 2


def test_chunk_placement():
    assert chunk_ranks(2, 2, "interleaved_1f1b") == [0, 1, 0, 1]  # rank 0 holds chunks 0 and p
    assert chunk_ranks(4, 1, "1f1b") == [0, 1, 2, 3]
    assert chunk_ranks(2, 2, "zbv") == [0, 1, 1, 0]  # a V: rank 0 holds the first and the last chunk


def test_in_flight_counts_forwards_not_yet_backwarded():
    t = Timeline(0, 1.0, [Action("F", 0, 0, 0, 0.1), Action("F", 0, 1, 0.1, 0.2), Action("B", 0, 0, 0.2, 0.3)])
    t.actions += [Action("F", 0, 2, 0.3, 0.4), Action("B", 0, 1, 0.4, 0.5), Action("B", 0, 2, 0.5, 0.6)]
    assert t.max_in_flight() == 2
    assert t.busy() == pytest.approx(0.6)


class _Reporting(torch.nn.Module):
    """A stage whose layer reports an auxiliary term, as an MoE block does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        report_aux(self.lin, "aux_loss", 0.1 * self.lin.weight.square().sum())
        return self.lin(x)


def test_an_earlier_stage_takes_its_aux_gradient_in_its_own_backward():
    """What pipeline_aux does for a stage before the last: backward from the output's gradient
    gives the parameters the gradient of (output . g) + aux, as when aux is a summand of the
    loss on one process; the logged value is the step's mean per micro-batch."""
    torch.manual_seed(0)
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    ref, part = _Reporting(), _Reporting()
    part.load_state_dict(ref.state_dict())
    ((ref(x) * g).sum() + sum(drain_aux(ref).values())).backward()
    aux = StageAux()
    aux.attach(part)
    for _ in range(2):  # two micro-batches, each with its own aux term
        part(x).backward(g)
    for a, b in zip(ref.parameters(), part.parameters(), strict=True):
        torch.testing.assert_close(b.grad, 2 * a.grad)
    assert drain_aux(part) == {}  # the hook took the terms
    (mean,) = aux.take(2).values()
    assert float(mean) == pytest.approx(0.1 * float(ref.lin.weight.detach().square().sum()))
    assert aux.take(2) == {}


def _cfg(world, **over):
    base = {"model.hidden": 64, "model.heads": 4, "model.kv_heads": 2, "model.ffn_hidden": 128, "model.layers": 4}
    return resolve(load_config(None, {**base, "train.global_batch_size": 8, **over}), world)


@pytest.mark.parametrize(
    "over, message",
    [
        ({"parallel.pp_schedule": "1f1c"}, "did you mean '1f1b'"),
        ({"parallel.pp_schedule": "looped"}, "valid: gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev"),
        ({"parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual_stages": 4}, "fewer than parallel.pp x"),
        ({"parallel.pp_schedule": "interleaved_1f1b"}, "set parallel.pp_virtual_stages = 2"),
        ({"parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 2}, "pick interleaved_1f1b"),
        ({"parallel.num_microbatches": 3}, "does not divide the per-rank batch"),
        ({"parallel.num_microbatches": 1}, "needs at least 2"),
        ({"train.micro_batch_size": 8}, "needs at least 2"),
        ({"parallel.pp_layers": [3, 2]}, "summing to model.layers = 4"),
        (sched(2, "interleaved_1f1b", 2, **{"parallel.pp_layers": [2, 0, 2, 0]}), "the first and the last may be 0"),
        ({"model.tie_embeddings": True}, "set model.tie_embeddings = false"),
        ({"parallel.zero_stage": 1, "parallel.dp_shard": 2}, "parallel.zero_stage = 1 with parallel.pp > 1"),
    ],
)
def test_bad_pipeline_settings_are_refused(over, message):
    world = 4 if "parallel.dp_shard" in over else 2
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(world, **{"parallel.pp": 2, **over})


def test_a_schedule_the_installed_torch_lacks_is_named(monkeypatch):
    import torch.distributed.pipelining as pipelining

    monkeypatch.delattr(pipelining, "ScheduleDualPipeV")
    with pytest.raises(ConfigError, match="lacks; use one of"):
        _cfg(2, **{"parallel.pp": 2, "parallel.pp_schedule": "dualpipev", "parallel.pp_virtual_stages": 2})


def test_explicit_stage_split_trains(tmp_path, corpus):
    d = tmp_path / "run"
    over = {**COMMON, "model.layers": 4, "train.steps": 2, "parallel.pp": 2, "parallel.pp_layers": [3, 1]}
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(d, corpus, **over)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(metrics(d)) == 2
