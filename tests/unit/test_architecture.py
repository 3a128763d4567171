"""The layers of docs/architecture.md, enforced: each folder imports only what its row of
ALLOWED names, and the analysing side (planner/, explore/, report/) reaches nothing of the
running side (train/, checkpoint/, health/, guards/, calibration/, cli/), directly or not."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# folder (or top-level module) of meshforge -> the folders it may import at run time, bottom up
ALLOWED: dict[str, set[str]] = {
    # the bottom: no meshforge imports, or only each other
    "meshforge": set(),
    "errors": set(),
    "compat": set(),  # the one home of torch version differences
    "ranges": set(),  # a number's range, declared in its field (config keys, the shape, the layout)
    "safeio": {"errors"},  # files as data: regular files read bounded, parsed with limits, schemas; no links written
    "launch": {"errors"},  # the launcher's environment, the local start of ranks, ranks tied to it
    "models": {"compat", "errors", "ranges", "safeio"},  # the one-device model: nothing of parallelism
    # the vocabulary: config keys (sections, Layout, ModelShape's fields), RunPlan
    "config": {"errors", "models", "ranges", "safeio"},
    "data": {"config", "errors", "models", "safeio"},
    "parallel": {"compat", "config", "errors", "launch", "models"},
    # Config + World -> RunPlan, once (data/: the tokenizer's vocabulary for model.vocab_size = "auto")
    "resolve": {"compat", "config", "data", "errors", "launch", "parallel"},
    # the run's parts, below train/ (train/ imports them, never the other way at run time)
    "metrics": {"config", "data", "errors", "models", "parallel", "safeio"},
    "health": {"config", "data", "errors", "launch", "parallel"},  # detectors, fault injection and its hooks
    "checkpoint": {
        *("compat", "config", "data", "errors", "health", "launch", "metrics", "models", "parallel", "safeio"),
    },
    # the analysing side: the shared core only (see SHARED_CORE)
    "planner": {"config", "errors", "metrics", "models", "parallel", "ranges", "safeio"},
    "report": {"errors", "planner", "safeio"},
    "explore": {"config", "errors", "models", "parallel", "planner", "ranges"},
    # what refuses a run before it writes, and what it may not write over (prices through planner/)
    "guards": {
        *("checkpoint", "config", "data", "errors", "health", "launch", "models", "parallel", "planner", "resolve"),
        "safeio",
    },
    "train": {
        *("checkpoint", "config", "data", "errors", "guards", "health", "launch", "metrics", "models"),
        *("parallel", "safeio"),
    },
    # the top: what drives the rest
    "calibration": {"compat", "config", "errors", "metrics", "models", "parallel", "planner", "resolve", "train"},
    "cli": {
        *("calibration", "checkpoint", "config", "data", "errors", "explore", "guards", "health", "launch"),
        *("models", "parallel", "planner", "report", "resolve", "safeio", "train"),
    },
    "__main__": {"cli"},
}
# imports under ``if TYPE_CHECKING:`` (names of types, never run) may also point up
TYPE_ONLY: dict[str, set[str]] = {}  # no upward import, not even for type checking

ANALYSING = ("planner", "explore", "report")
RUNNING = ("train", "checkpoint", "health", "calibration", "guards", "cli")
# what the analysing side may import from outside itself, module by module
SHARED_CORE = {
    "meshforge.errors",
    "meshforge.safeio",  # files as data: the report reads a run's files as every command reads its input
    "meshforge.ranges",  # a key's range (the field's metadata), which plan's flags and the explorer check
    "meshforge.config",  # plan --config reads a train config; --emit-config writes one
    # the layout rules: the aggregate, their types, the degrees, partial layouts, and each axis's own
    "meshforge.parallel.rules",
    "meshforge.parallel.rule_types",
    "meshforge.parallel.degrees",
    "meshforge.parallel.partial_rules",
    *(f"meshforge.parallel.{axis}.rules" for axis in ("data", "tensor", "pipeline", "context", "expert", "diloco")),
    "meshforge.parallel.pipeline.schedules",  # the pipeline schedules' facts (chunks per rank, bubble)
    "meshforge.config.layout",  # Layout: the one layout type
    "meshforge.models.shape",  # ModelShape: the one model-shape type
    "meshforge.models.flops",  # the one FLOP/parameter counter
    "meshforge.models.presets",
    "meshforge.models.llama",  # the model, as a type
    "meshforge.models.moe",  # is_moe_layer, expert_ffn: which blocks are MoE, an expert's size
    "meshforge.parallel.expert.dispatch",  # a2a_bytes_formula: the planner prices what training sends
    "meshforge.planner.context_costs",  # ring attention's cost formulas
    "meshforge.parallel.tensor.ring_pieces",  # async TP's pieces per chunk: the planner prices the same rings
    "meshforge.models.chunked_loss",  # LOSS_CHUNK_SIZE: the planner's logits term counts one chunk
    "meshforge.metrics.mfu",  # PEAK_TFLOPS: the datasheet peaks MFU and the planner share
    "meshforge.metrics.cpu_peak",  # this CPU's measured, cached figures: the planner's hardware for a CPU run
}


def in_core(module: str) -> bool:
    """Whether a module is the shared core: named in SHARED_CORE, or a module of a package named there."""
    return any(module == c or module.startswith(c + ".") for c in SHARED_CORE)


def unit(module: str) -> str:
    """meshforge.planner.search -> planner; meshforge.cli.main -> cli; meshforge -> meshforge."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def import_graph() -> dict[str, dict[str, bool]]:
    """meshforge module -> {imported meshforge module: whether only under TYPE_CHECKING};
    function-local imports included."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, dict[str, bool]] = {m: {} for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                if t in files and t != mod and t != "meshforge":
                    graph[mod][t] = graph[mod].get(t, True) and id(node) in typing_only
    return graph


def wall_breaches(graph: dict[str, dict[str, bool]]) -> list[str]:
    """Every import against ALLOWED, TYPE_ONLY or SHARED_CORE, as 'module -> module (why)'."""
    out = []
    for mod, targets in sorted(graph.items()):
        src = unit(mod)
        for t, typing_only in sorted(targets.items()):
            dst = unit(t)
            if dst != src and dst not in ALLOWED[src] and not (typing_only and dst in TYPE_ONLY.get(src, ())):
                out.append(f"{mod} -> {t} ({src}/ may not import {dst}/{' even for types' if typing_only else ''})")
            if src in ANALYSING and dst not in ANALYSING and not in_core(t):
                out.append(f"{mod} -> {t} (not in the shared core)")
    return out


def reach(graph: dict[str, dict[str, bool]], start: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        for n in set(graph[todo.pop()]) - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_every_folder_imports_only_what_its_layer_allows():
    graph = import_graph()
    assert set(map(unit, graph)) <= set(ALLOWED), set(map(unit, graph)) - set(ALLOWED)  # a new folder needs a row
    assert wall_breaches(graph) == []


@pytest.mark.parametrize("side", ANALYSING)
def test_the_analysing_side_never_reaches_the_running_side(side):
    graph = import_graph()
    reached = reach(graph, [m for m in graph if unit(m) == side])
    assert not {m for m in reached if unit(m) in RUNNING}, sorted(m for m in reached if unit(m) in RUNNING)


def test_the_wall_test_can_fail():
    graph = import_graph()
    graph["meshforge.planner.search"]["meshforge.train.step"] = False
    graph["meshforge.metrics.sinks"]["meshforge.train.loop"] = False
    graph["meshforge.health.keeper"]["meshforge.train.optimizer"] = True  # for types only: still refused
    graph["meshforge.explore.params"]["meshforge.parallel.mesh"] = False
    graph["meshforge.explore.params"]["meshforge.parallel.partial_rules"] = False  # the rules' package: core
    assert wall_breaches(graph) == [
        "meshforge.explore.params -> meshforge.parallel.mesh (not in the shared core)",
        "meshforge.health.keeper -> meshforge.train.optimizer (health/ may not import train/ even for types)",
        "meshforge.metrics.sinks -> meshforge.train.loop (metrics/ may not import train/)",
        "meshforge.planner.search -> meshforge.train.step (planner/ may not import train/)",
        "meshforge.planner.search -> meshforge.train.step (not in the shared core)",
    ]
    assert "meshforge.train.step" in reach(graph, ["meshforge.report.run_report"])
