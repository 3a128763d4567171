"""One path through a run (issue 49): the config file is read once, by the checked loader; the
pre-flight runs once per launch and the run lock is taken in one place, however many ranks; the
plan the launcher hands its ranks comes back exactly, and only from that launcher; each thing
the run derives is derived in one place (the batch split, the loss group, the layout's reads);
the model knows nothing of the vocab-parallel loss."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import cli_args, rendezvous, run_cli, tiny_config, tiny_overrides
from meshforge.config.layout import Layout
from meshforge.config.load import _read_regular
from meshforge.config.run_plan import ResumePoint, RunPlan
from meshforge.errors import ConfigError
from meshforge.launch import tie
from meshforge.resolve import resolve

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge"


# --- the config file: read once, by the checked loader -------------------------------------


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_config_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    """``--config /dev/zero`` used to hang: the run lock's early look parsed the file before the
    loader refused it. (The timeout only keeps a regression from hanging the suite.)"""
    if kind == "device":
        path = "/dev/zero"
    else:
        path = str(tmp_path / "config.fifo")
        os.mkfifo(path)  # nobody ever writes: a read would wait forever
    r = run_cli("train", "--config", path, "--run.dir", str(tmp_path / "run"), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "is not a regular file (a device, FIFO or socket)" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_the_loader_reads_the_open_file_and_never_waits_on_a_fifo(tmp_path):
    """A FIFO put where the config was after the path checks is refused from the open file itself."""
    fifo = tmp_path / "late.fifo"
    os.mkfifo(fifo)
    said: list[str] = []

    def read() -> None:
        try:
            _read_regular(fifo)
        except ConfigError as e:
            said.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)  # a blocking open never returns: fail instead of hanging
    assert said and "not a regular file" in said[0]
    (tmp_path / "c.toml").write_bytes(b"[train]\r\nsteps = 3\r\n")
    assert _read_regular(tmp_path / "c.toml") == b"[train]\r\nsteps = 3\r\n"


# --- once per launch: the pre-flight, the lock, the resolution, the read ------------------------

COUNTER = """
import os
from pathlib import Path

def _count(module, name, what):
    inner = getattr(module, name)
    def counted(*a, **k):
        said = f"{what}:{Path(a[0]).name}" if what == "read" else what
        with open(os.environ["MESHFORGE_TEST_COUNTS"], "a") as f:
            f.write(f"{os.getpid()} {'rank' if 'LOCAL_RANK' in os.environ else 'launcher'} {said}\\n")
        return inner(*a, **k)
    setattr(module, name, counted)

import meshforge.config.load as load
import meshforge.guards.preflight as preflight
import meshforge.guards.run_lock as run_lock
import meshforge.resolve as resolve

_count(load, "_read_file", "read")
_count(preflight, "preflight", "preflight")
_count(preflight, "resolve", "resolve")
_count(resolve, "resolve", "resolve")
_count(run_lock, "acquire", "lock")
"""


def test_a_two_rank_launch_checks_resolves_reads_and_locks_once(tmp_path, corpus):
    """``meshforge train --nproc 2 --config FILE``: the launcher reads the file, runs the pre-flight
    (one resolution) and takes the lock, once each; its ranks do none of it (they train on the plan
    it hands them). Counted by wrapping those functions in every process (a sitecustomize). (The
    fit check prices the plan through the planner, and the run report reads the run's config.toml:
    neither is the user's file.)"""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(COUNTER)
    counts = tmp_path / "counts.txt"
    o = tiny_overrides(tmp_path / "run", corpus, **{"train.steps": 2, "train.eval_batches": 0})
    config = tmp_path / "c.toml"
    config.write_text('[train]\nsteps = 2\n[run]\ndir = "elsewhere"\n')
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    env["MESHFORGE_TEST_COUNTS"] = str(counts)
    r = run_cli("train", "--nproc", "2", "--config", str(config), *cli_args(o), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line.split() for line in counts.read_text().splitlines()]
    launcher = [what for _, who, what in lines if who == "launcher"]
    ranks = [what for _, who, what in lines if who == "rank" and what != "read:config.toml"]
    assert [launcher.count(w) for w in ("read:c.toml", "preflight", "resolve", "lock")] == [1, 1, 1, 1], launcher
    assert ranks == [], f"a rank repeated the launcher's work: {lines}"
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (tmp_path / "run" / "run.lock").exists()  # the one holder let go


def _calls(name: str) -> list[str]:
    """Where in src a function ``name`` of meshforge's is called, bare or as ``run_lock.name`` /
    ``preflight.name`` (a semaphore's ``acquire`` is not ours): 'file.py:function' per caller."""
    out = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                f = node.func if isinstance(node, ast.Call) else None
                ours = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                ours = ours and f.value.id in ("run_lock", "preflight")
                called = f.id if isinstance(f, ast.Name) else f.attr if ours else None
                if called == name:
                    out.append(f"{path.relative_to(SRC)}:{fn.name}")
    return sorted(set(out))


def test_one_place_runs_the_preflight_and_one_takes_the_lock():
    assert _calls("preflight") == ["cli/train.py:_launch"]
    assert _calls("hold") == ["cli/train.py:holding_run_dir"]
    assert _calls("acquire") == ["guards/run_lock.py:hold"]


def test_the_busy_look_creates_nothing_and_names_the_holder(tmp_path):
    from meshforge.guards import run_lock

    run_lock.refuse_if_held(tmp_path / "missing")  # no run.dir: free, and none is made
    assert not (tmp_path / "missing").exists()
    run_lock.refuse_if_held(tmp_path)  # no lock file: free, and none is made
    assert not (tmp_path / run_lock.LOCK_NAME).exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunDirLocked, match=f"PID {holder.pid}"):
            run_lock.refuse_if_held(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    run_lock.refuse_if_held(tmp_path)  # its holder died: stale, free to take over


HOLD = (
    "import sys, time; from meshforge.guards import run_lock; run_lock.acquire(sys.argv[1]); "
    "print('held', flush=True); time.sleep(600)"
)


# --- the plan handed to the ranks ---------------------------------------------------------------


@pytest.mark.parametrize(
    "over, world",
    [
        ({}, 1),
        ({"parallel.tp": 2, "checkpoint.interval": "auto"}, 2),
        ({"parallel.pp": 2, "parallel.pp_layers": [1, 1], "train.precision": "bf16"}, 2),
        ({"model.preset": "debug-moe", "parallel.dp_shard": 2, "train.micro_batch_size": 2}, 2),
    ],
)
def test_the_plan_a_launcher_hands_over_comes_back_exactly(tmp_path, corpus, over, world):
    plan = resolve(tiny_config(tmp_path / "run", corpus, **over), world, ranks_per_node=world)
    plan = plan.with_resume(ResumePoint(str(tmp_path / "ckpt"), (("old", "hash does not match"),), 0))
    assert RunPlan.from_json(plan.to_json()) == plan


def test_a_tampered_or_foreign_plan_is_refused(tmp_path, corpus, monkeypatch):
    doc = json.loads(resolve(tiny_config(tmp_path / "run", corpus), 1).to_json())
    bad = json.loads(json.dumps(doc))
    bad["config"]["train"]["steps"] = -3
    with pytest.raises(ConfigError, match="train.steps"):
        RunPlan.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(doc))
    bad["world"]["size"] = "2"
    with pytest.raises(ConfigError, match="world.size must be an integer"):
        RunPlan.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(doc))
    del bad["decided"]["fsdp"]
    with pytest.raises(ConfigError, match="not readable"):
        RunPlan.from_json(json.dumps(bad))
    with pytest.raises(ConfigError, match="not readable"):
        RunPlan.from_json("[" * 100_000)
    monkeypatch.setenv(tie.PLAN_ENV, json.dumps(doc))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(tie.LAUNCHER_ENV, "1")  # not our parent: not our launcher
    with pytest.raises(ConfigError, match="not a rank started by `meshforge train --nproc N`"):
        tie.handed_plan()
    monkeypatch.setenv(tie.LAUNCHER_ENV, str(os.getppid()))
    assert tie.handed_plan() == json.dumps(doc)


# --- derived once ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lay, gb, split",
    [
        (Layout(dp_shard=2), 8, (4, 4, 1)),
        (Layout(dp_shard=2, micro_batch_size=1), 8, (4, 1, 4)),
        (Layout(pp=2, num_microbatches=4), 8, (8, 2, 4)),
        (Layout(pp=2, micro_batch_size=2), 8, (8, 2, 4)),
        (Layout(pp=2, pp_virtual_stages=2), 12, (12, 2, 6)),  # largest divisor of 12 up to 2 x 2 x 2
        (Layout(islands=2, dp_shard=2), 8, (2, 2, 1)),
    ],
)
def test_the_batch_split_has_one_owner(lay, gb, split):
    b = lay.batch_split(gb)
    assert (b.local, b.micro, b.count) == split


def _source_hits(pattern: str, allowed: set[str]) -> list[str]:
    return [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if pattern in p.read_text() and str(p.relative_to(SRC)) not in allowed
    ]


def test_the_loop_takes_a_plan_only(tmp_path, corpus):
    from meshforge.train.loop import train

    with pytest.raises(TypeError, match="takes the run plan the pre-flight accepted"):
        train(tiny_config(tmp_path / "run", corpus))
    assert not (tmp_path / "run").exists()


def test_the_loss_group_and_the_layout_are_read_one_way():
    assert _source_hits('"dp_cp" if', {"parallel/mesh.py"}) == []  # Mesh.loss_name / loss_group
    assert _source_hits("mesh.layout", set()) == []  # the layout is the plan's: plan.layout
    assert _source_hits("mesh._layout", set()) == []
    for gone in ("def local_batch", "def microbatches", "def micro_batch", "def runner_accum"):
        assert _source_hits(gone, set()) == [], gone


def test_the_model_knows_nothing_of_the_vocab_parallel_loss():
    for path in (SRC / "models").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.startswith("torch.distributed")], path


def _vocab_worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshforge.models.chunked_loss import chunked_cross_entropy
    from meshforge.parallel.tensor.vocab_loss import vocab_parallel_cross_entropy

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 10, 16, generator=g), torch.randn(40, 16, generator=g) / 4
        t = torch.randint(0, 40, (3, 10), generator=g)
        t[0, :3] = -100
        x0, w0 = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = chunked_cross_entropy(x0, w0, t, 7)
        ref.backward()
        mesh = init_device_mesh("cpu", (2,))
        xd = distribute_tensor(x.clone(), mesh, [Replicate()]).requires_grad_()
        wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        got = vocab_parallel_cross_entropy(xd, wd, t, 7)
        got.backward()
        if rank == 0:
            gx, gw = xd.grad.full_tensor(), wd.grad.full_tensor()
            torch.save({"ref": (ref, x0.grad, w0.grad), "got": (got.detach(), gx, gw)}, out)
        else:
            xd.grad.full_tensor(), wd.grad.full_tensor()
    finally:
        dist.destroy_process_group()


def test_the_vocab_parallel_loss_equals_the_one_device_loss(tmp_path):
    """parallel/tensor/vocab_loss.py over a vocab-sharded head (2 ranks) against
    models/chunked_loss.py on the whole head: the same loss and gradients (fp32 sums in another order)."""
    store = rendezvous()
    out = str(tmp_path / "out.pt")
    mp.spawn(_vocab_worker, args=(store, out), nprocs=2, join=True)
    r = torch.load(out)
    for ref, got in zip(r["ref"], r["got"], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
