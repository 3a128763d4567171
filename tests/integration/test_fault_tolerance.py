"""Live recovery across replica groups (torchft): two `meshforge train` groups behind one lighthouse
train as the single process does; a group SIGKILLed mid-run is left behind at the next step (the
survivor never restarts), starts again, heals from the survivor and ends on bit-identical weights;
bad input (no lighthouse, a duplicate replica id, another config, no quorum) is refused, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_same_weights, cli_args, tiny_config, tiny_overrides, train
from meshforge.checkpoint.weights import load_weights

pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")

STEPS = 8


def rows(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def events(d: Path, *kinds: str) -> list[dict]:
    found = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    return [e for e in found if e["event"] in kinds]


@pytest.fixture
def lighthouse():
    """A lighthouse in this process: ``start(min_replicas)`` -> its URL."""
    from torchft.coordination import LighthouseServer

    servers = []

    def start(min_replicas: int) -> str:
        s = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=1000, heartbeat_timeout_ms=1000
        )
        servers.append(s)
        return f"http://127.0.0.1:{s.address().rsplit(':', 1)[1]}"

    yield start
    for s in servers:
        s.shutdown()


def group(d: Path, corpus: Path, url: str, replica: int, nproc: int = 1, fault: str = "", **extra) -> subprocess.Popen:
    """One replica group (`meshforge train`, its own run.dir), started in the background."""
    ft = {"fault_tolerance.enabled": True, "fault_tolerance.lighthouse": url, "fault_tolerance.replicas": 2}
    o = tiny_overrides(d, corpus, **{"train.steps": STEPS, "fault_tolerance.replica_id": replica, **ft, **extra})
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", str(nproc), *cli_args(o)]
    env = {**os.environ, "MESHFORGE_FAULT": fault}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


def wait_for(d: Path, step: int, replicas: int = 1, timeout: float = 240) -> None:
    """Until the group writing ``d`` has logged a step >= ``step`` with >= ``replicas`` live groups."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (d / "metrics.jsonl").exists():
            done = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()[:-1])]
            if any(r["step"] >= step and r.get("replicas", 1) >= replicas for r in done):
                return
        time.sleep(0.2)
    raise AssertionError(f"{d}: no step {step} with {replicas} groups within {timeout} s")


def same_bits(a: Path, b: Path) -> bool:
    x, y = (load_weights(d / "final").state_dict() for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,layout",
    [(1, {}), (2, {"parallel.zero_stage": 3}), (2, {"parallel.tp": 2}), (2, {"parallel.pp": 2})],
    ids=["one-rank", "zero3", "tp2", "pp2"],
)
def test_two_groups_train_as_the_single_process(tmp_path, corpus, lighthouse, nproc, layout):
    """Each group reads its half of every global batch and the groups average gradients: losses and
    gradient norms equal the single process's (fp32, 1e-6), the groups' final weights are bit-identical."""
    url = lighthouse(2)  # a quorum of both: every step has both groups
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [group(a, corpus, url, 0, nproc, **layout), group(b, corpus, url, 1, nproc, **layout)]
    for p in procs:
        code, err = finish(p)
        assert code == 0, err[-3000:]
    ref = tmp_path / "ref"
    train(tiny_config(ref, corpus, **{"train.steps": STEPS}))
    want, got = rows(ref), rows(a)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-6)
    assert [r["replicas"] for r in got] == [2] * STEPS and [r["loss"] for r in rows(b)] == [r["loss"] for r in got]
    assert same_bits(a, b)
    assert_same_weights(ref, a)
    assert events(a, "replica_lost", "skipped_batches", "healed_from") == []


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layout", [(1, {}), (2, {"parallel.zero_stage": 3})], ids=["one-rank", "zero3"])
def test_a_killed_group_is_left_behind_then_rejoins_and_heals(tmp_path, corpus, lighthouse, nproc, layout):
    """Group 1 is SIGKILLed mid-run and started again: group 0 goes on alone (its process never
    restarts: one `world` event), replicas 2 -> 1 -> 2, the slices group 1 missed are recorded, the
    rejoined group heals from group 0 inside a step (asynchronous quorum) and both end on the same
    bits (each rank its own shard, under ZeRO-3)."""
    url = lighthouse(1)
    a, b = tmp_path / "a", tmp_path / "b"
    # The survivor must still be training when the group comes back: its restart (imports, a
    # two-rank ZeRO-3 build) took longer than the survivor's last 30 steps once, under the full
    # suite's load. So 60 steps, the survivor paced at 300 ms (the pair goes at the slower pace),
    # and the group started again as soon as it is dead (its start-up alone outlasts the survivor's
    # first solo steps, which the checks below still require).
    common = {"train.steps": 60, **layout}
    survivor = group(a, corpus, url, 0, nproc, fault="pace:ms=300", **common)
    victim = group(b, corpus, url, 1, nproc, fault="pace:ms=150", **common)
    wait_for(a, 8, replicas=2)
    victim.kill()  # SIGKILL: the group's launcher (its ranks die with it: PR_SET_PDEATHSIG)
    victim.wait()
    code, err = finish(group(b, corpus, url, 1, nproc, fault="pace:ms=150", **common))
    assert code == 0, err[-3000:]
    code, err = finish(survivor)
    assert code == 0, err[-3000:]
    assert len(events(a, "world")) == 1  # the survivor's one start
    got = rows(a)  # (it may start past step 1: min_replicas = 1, so the group that starts first trains alone
    steps, live = [r["step"] for r in got], [r["replicas"] for r in got]  # and the other heals from it)
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # every committed step once, none retaken twice
    start = live.index(2)  # (group 1 may have joined a step or two late)
    lost = live.index(1, start)
    joined = live.index(2, lost)
    assert set(live[start:lost]) == {2} and set(live[lost:joined]) == {1} and set(live[joined:]) == {2}
    lost, joined = steps[lost], steps[joined]  # as steps
    assert {"replica": 1, "step": lost} in [{k: e[k] for k in ("replica", "step")} for e in events(a, "replica_lost")]
    assert events(a, "replica_joined")[-1]["step"] == joined
    skipped = events(a, "skipped_batches")[-1]
    assert skipped["replica"] == 1 and skipped["steps"] == [lost, joined - 1] and skipped["batches"] == joined - lost
    healed = events(b, "healed_from")[-1]  # inside step joined - 1 (asynchronous quorum): the state when it began
    assert healed["replica"] == 0 and healed["step"] == joined - 2
    mine = rows(b)  # the healing step: the survivor's update, without the joiner's own slice (skipped above)
    assert [r["replicas"] for r in mine if r["step"] >= joined - 1][:2] == [1, 2]
    drop_time = lambda e: {k: v for k, v in e.items() if k != "time"}  # noqa: E731
    assert drop_time(events(b, "skipped_batches")[-1]) == drop_time(skipped)  # it took over the survivor's record
    assert same_bits(a, b)


def test_an_unreachable_lighthouse_is_refused_before_anything_is_written(tmp_path, corpus):
    d = tmp_path / "run"
    code, err = finish(group(d, corpus, "http://127.0.0.1:9", 0))
    assert code == 2 and "does not answer" in err and "meshforge lighthouse" in err
    assert not d.exists()


@pytest.mark.slow
def test_a_duplicate_id_another_config_and_no_quorum_are_refused(tmp_path, corpus, lighthouse):
    """Beside a training group 0: another group 0 is refused, and so is a group 1 of another model shape
    (it heals first and compares); a lighthouse that needs 2 groups while 1 runs: no quorum, exit 2."""
    url = lighthouse(1)
    a = tmp_path / "a"
    training = group(a, corpus, url, 0, fault="pace:ms=200", **{"train.steps": 60})
    wait_for(a, 2)
    twin = group(tmp_path / "twin", corpus, url, 0, **{"train.steps": 60})
    code, err = finish(twin)
    assert code == 2 and "also has fault_tolerance.replica_id = 0" in err, err[-3000:]
    assert not (tmp_path / "twin").exists()  # refused: nothing written
    other = group(tmp_path / "other", corpus, url, 1, **{"train.steps": 60, "model.hidden": 32})
    code, err = finish(other)
    assert code == 2 and "config differs" in err and "model.hidden = 32 here, 64 there" in err, err[-3000:]
    assert not (tmp_path / "other").exists()
    training.kill()
    training.wait()
    lonely = group(tmp_path / "lonely", corpus, lighthouse(2), 0, **{"fault_tolerance.quorum_timeout_s": 3})
    code, err = finish(lonely)
    assert code == 2 and "no quorum of fault_tolerance.min_replicas" in err, err[-3000:]
    assert not (tmp_path / "lonely").exists()


@pytest.mark.slow
def test_a_lighthouse_that_dies_mid_run_stops_the_group_with_a_resumable_checkpoint(tmp_path, corpus):
    """`meshforge lighthouse` in the foreground, killed while a group trains: the group reports it
    (lighthouse_lost), saves a complete checkpoint to resume from and stops, exit 2."""
    port = free_port()
    cmd = [sys.executable, "-m", "meshforge", "lighthouse", "--bind", f"127.0.0.1:{port}", "--min-replicas", "1"]
    house = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on" in house.stdout.readline()
        a = tmp_path / "a"
        extra = {"train.steps": 200, "fault_tolerance.quorum_timeout_s": 5}
        training = group(a, corpus, f"http://127.0.0.1:{port}", 0, fault="pace:ms=100", **extra)
        wait_for(a, 3)
    finally:
        house.kill()
        house.wait()
    code, err = finish(training)
    assert code == 2 and "stopped answering" in err and "meshforge lighthouse" in err, err[-3000:]
    (lost,) = events(a, "lighthouse_lost")
    done = sorted((a / "checkpoints").glob("step-*/COMPLETE"))
    assert done and int(done[-1].parent.name.split("-")[1]) == lost["step"] >= 3


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_flipped_bit_in_one_group_is_found_across_the_groups(tmp_path, corpus, lighthouse):
    """The silent-corruption check compares the replica groups too: a bit flipped in group 1 after
    step 3 is an sdc event at step 4 in both groups, naming both (two groups: no majority)."""
    url = lighthouse(2)
    a, b = tmp_path / "a", tmp_path / "b"
    check = {"health.sdc_interval": 2}
    procs = [group(a, corpus, url, 0, **check), group(b, corpus, url, 1, fault="bitflip:rank=0:step=3", **check)]
    for p in procs:
        code, err = finish(p)
        assert code == 0, err[-3000:]
    for d in (a, b):
        (e,) = events(d, "sdc")
        assert e["step"] == 4 and e["replicas"] == [0, 1] and not e["decided"] and e["ranks"] == [0]
        assert e["params"] == ["tok_embeddings.weight"]
