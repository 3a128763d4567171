"""Layout rules live in one place (parallel/rules.py): the planner and `meshforge train`'s
config check give the same verdict on every layout, and the import graph has no cycles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_architecture import import_graph

from meshforge.config import load_config
from meshforge.config.layout import Layout, open_layout
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape
from meshforge.parallel.rules import Batch, problems, rank_layout, resolve_degrees
from meshforge.planner import output
from meshforge.planner.candidates import candidates, judge
from meshforge.planner.estimate import estimate
from meshforge.planner.hardware import get_hardware
from meshforge.resolve import resolve

SRC = Path(__file__).resolve().parents[2] / "src"
GPUS, PER_NODE, BATCH = 8, 8, 16


def _verdicts(shape: ModelShape, seq: int, fixed: Layout):
    hw = get_hardware("h100-sxm")
    for lay in candidates(shape, GPUS, BATCH, seq, fixed, PER_NODE):
        exists, reason = judge(lay, shape, seq, BATCH, PER_NODE)
        e = estimate(shape, lay, seq, BATCH, "bf16", hw, PER_NODE)
        yield lay, exists, reason, output.emitted_config(e, shape, seq, BATCH, "bf16", None)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("seq", [32, 30])
@pytest.mark.parametrize(
    "fixed", [open_layout(), open_layout(cp=2), open_layout(pp=2, pp_schedule="zero_bubble")]
)  # (interleaving needs pp > 2)
def test_planner_and_train_agree_on_every_layout(tmp_path, monkeypatch, tie, seq, fixed):
    """Every layout the planner considers for a small model on 8 ranks: the planner ranks it
    as runnable exactly when `meshforge train`'s config check accepts its emitted config,
    and when either refuses, both give the same reason."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(PER_NODE))
    shape = ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, tie_embeddings=tie)
    seen = {"runs": 0, "refused": 0, "invalid": 0}
    for i, (lay, exists, reason, toml) in enumerate(_verdicts(shape, seq, fixed)):
        path = tmp_path / f"{i}.toml"
        path.write_text(toml)
        cfg = load_config(path)
        if exists and not reason:
            got = resolve(cfg, GPUS).layout
            assert (got.tp, got.pp, got.cp, got.dp_shard, got.zero_stage) == (
                lay.tp,
                lay.pp,
                lay.cp,
                lay.dp_shard,
                lay.zero_stage,
            )
            seen["runs"] += 1
        else:
            with pytest.raises(ConfigError) as err:
                resolve(cfg, GPUS)
            assert str(err.value) == reason, lay
            seen["refused" if exists else "invalid"] += 1
    assert seen["runs"] + seen["refused"] + seen["invalid"] > 20
    if fixed.cp:  # cp 2 runs when 2 x cp divides seq_len; ZeRO-1 under tp or pp is refused by name (cp or not)
        assert seen["runs"] > 0 if seq % 4 == 0 else seen["runs"] == 0
        assert seen["refused"] > 0 or seq % 4
    elif not tie:
        assert seen["runs"] > 0
    if seq == 30 and not fixed.cp:
        assert seen["invalid"] > 0  # tp 4 cannot split 30 positions under SP


def test_dims_infers_one_degree_and_names_the_fix():
    d = resolve_degrees(Layout(pp=2, dp_shard=-1, tp=2), 8)
    assert (d.dp_shard, d.world_size, d.dp) == (2, 8, 2)
    assert d.uses_fsdp()  # dp under pp runs on FSDP2
    assert not resolve_degrees(Layout(dp_shard=2), 2).uses_fsdp()
    with pytest.raises(ConfigError, match="only one parallel degree may be -1"):
        resolve_degrees(Layout(pp=-1, dp_shard=-1), 8)
    model = ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512)
    found = problems(Layout(tp=8), model, Batch(seq_len=32, global_batch=8))
    assert [p.key for p in found][:2] == ["model.heads", "model.kv_heads"]
    assert rank_layout({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2})[3] == {
        "rank": 3, "pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1
    }  # fmt: skip


# ----------------------------------------------------------------------------- imports


def _import_graph() -> dict[str, set[str]]:
    """meshforge module -> the meshforge modules it imports (anywhere in the file, also
    function-local and TYPE_CHECKING imports: a cycle hidden behind them is still a cycle).
    The walker is the wall test's (tests/unit/test_architecture.py), without its typing-only flags."""
    return {m: set(targets) for m, targets in import_graph().items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles_in_src():
    graph = _import_graph()
    assert len(graph) > 30 and graph["meshforge.resolve"] >= {"meshforge.config", "meshforge.parallel.rules"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_config_imports_nothing_from_parallel_or_planner():
    graph = _import_graph()
    reach, todo = set(), ["meshforge.config"]
    while todo:
        for n in graph[todo.pop()] - reach:
            reach.add(n)
            todo.append(n)
    assert not {m for m in reach if m.startswith(("meshforge.parallel", "meshforge.planner"))}, reach
    # and the layout rules are pure: no process groups, no torch at all; they read the shared core only
    core = {
        "meshforge.errors",
        "meshforge.models.shape",
        "meshforge.config.layout",
        "meshforge.parallel.pipeline.schedules",
    }
    generic = ("rules", "rule_types", "degrees", "partial_rules")
    package = [f"meshforge.parallel.{m}" for m in generic] + [
        m for m in graph if m.endswith(".rules") and m != "meshforge.parallel.rules"
    ]
    assert len(package) == 11  # the aggregate, its types, degrees, partial layouts, and seven homes' rules.py
    for mod in package:
        assert not {m for m in graph[mod] if m not in core and m not in package}, mod
    code = "import sys, meshforge.parallel.rules; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC)}).returncode == 0
    files = [SRC / (m.replace(".", "/") + ".py") for m in package]
    assert not [p for p in files if "import torch" in p.read_text()]


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
