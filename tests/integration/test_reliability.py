"""Reliability at the edges: ranks die with their launcher, one run per run.dir, disk errors said
once (exit 2) with nothing lost beyond the last checkpoint, and documented exit codes on every rank.

The full- and read-only-disk runs use a real tmpfs (``mount -t tmpfs``; they are skipped where
mounting is not permitted); the unit tests beside them use a write-failing shim instead.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from conftest import cli_args, run_cli, tiny_config, tiny_overrides
from meshforge.guards import disk, run_lock
from meshforge.guards.disk import DiskError

HOLDER = (
    "import sys, time; from meshforge.guards import run_lock; run_lock.acquire(sys.argv[1]); "
    "print('held', flush=True); time.sleep(600)"
)


def hold_elsewhere(d: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_into_a_locked_run_dir_is_refused_naming_the_holder(tmp_path, corpus):
    d = tmp_path / "run"
    d.mkdir()
    holder = hold_elsewhere(d)
    try:
        r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(d, corpus)), timeout=120)
        assert r.returncode == 2, r.stderr
        assert f"PID {holder.pid}" in r.stderr and "in use by another meshforge run" in r.stderr
        assert "Traceback" not in r.stderr and not (d / "config.toml").exists()  # refused before anything ran
    finally:
        holder.kill()
        holder.wait()
    lock = run_lock.acquire(d)  # its holder was SIGKILLed: the lock is stale, taken over and named
    try:
        note = run_lock.stale_note(lock)
        assert note and f"PID {holder.pid}" in note and "no longer running" in note
        assert run_lock.acquire(d) is None  # this process holds it already (a restart does not lock itself out)
    finally:
        lock.release()
    assert not (d / run_lock.LOCK_NAME).exists()


def test_a_symlink_in_place_of_the_lock_is_refused_and_nothing_it_points_at_is_touched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    d = tmp_path / "run"
    d.mkdir()
    (d / run_lock.LOCK_NAME).symlink_to(victim)
    with pytest.raises(run_lock.RunDirLocked, match=r"run.lock is a symbolic link .*remove the link"):
        run_lock.acquire(d)
    assert victim.read_text() == "precious\n"  # not truncated, not written, not removed
    (d / run_lock.LOCK_NAME).unlink()
    lock = run_lock.acquire(d)
    (d / run_lock.LOCK_NAME).unlink()
    (d / run_lock.LOCK_NAME).symlink_to(victim)  # put in its place while held
    lock.release()
    assert victim.read_text() == "precious\n" and (d / run_lock.LOCK_NAME).is_symlink()  # not ours: left alone


def test_disk_errors_name_the_path_the_errno_and_the_fix(tmp_path, corpus, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskError, match=r"file: Not a directory \(ENOTDIR\); a part of the path is a file"):
        disk.probe_run_dir(tmp_path / "file" / "run")
    with pytest.raises(DiskError, match=r"less than one checkpoint needs .*\(ENOSPC\)"):
        disk.check_free_space(tmp_path, 10**18, "one checkpoint")
    disk.check_disk(tiny_config(tmp_path / "run", corpus))  # room enough, writable: nothing said
    assert not (tmp_path / "run").exists()  # the probe leaves nothing behind

    def read_only(*a, **k):  # the shim: a filesystem that refuses writes
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x"))

    monkeypatch.setattr(disk.os, "fsync", read_only)
    with pytest.raises(DiskError, match=r"Read-only file system \(EROFS\); the filesystem is mounted read-only"):
        disk.probe_run_dir(tmp_path)


def test_disk_errors_are_found_inside_a_checkpoint_exception(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x/__0_0.distcp")
    wrapped = CheckpointException("save failed", {1: (full, traceback.StackSummary())})
    assert "No space left on device (ENOSPC)" in str(disk.disk_error(wrapped, tmp_path))
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(disk, "_nearly_full", lambda d, need=0: True)
    assert "(ENOSPC)" in str(disk.disk_error(short, tmp_path))
    assert disk.disk_error(ValueError("a bug"), tmp_path) is None


def test_a_short_write_with_less_room_than_a_checkpoint_is_a_full_disk(tmp_path, monkeypatch):
    """Rank 0 frees its partial save before another rank judges the same gathered failure: the
    room left is then more than zero but less than a checkpoint, which still says ENOSPC."""
    from torch.distributed.checkpoint.api import CheckpointException

    usage = type(shutil.disk_usage(tmp_path))
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: usage(30 * 2**20, 22 * 2**20, 8 * 2**20))
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    gathered = CheckpointException("save failed", {0: (short, traceback.StackSummary())})
    assert "(EIO)" in str(disk.disk_error(gathered, tmp_path))  # no size known: 8 MiB free is not full
    found = disk.disk_error(gathered, tmp_path, need=11 * 2**20)
    assert "No space left on device (ENOSPC)" in str(found) and found.every_rank  # DCP gave it to every rank
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x/rank-00001.json")
    assert not disk.disk_error(full, tmp_path).every_rank  # this rank's own write: it says it itself


@pytest.mark.parametrize("local_rank,said", [("0", True), ("1", False)])
def test_an_every_rank_error_is_said_once_per_node(monkeypatch, capsys, local_rank, said):
    from meshforge.cli import main as cli
    from meshforge.cli import train as cli_train
    from meshforge.health import peer_lost
    from meshforge.health.keeper import HealthStop

    def stop(argv):
        raise HealthStop("non-finite loss at step 3 on rank(s) [1]; stopping the run")

    monkeypatch.setattr(cli_train, "cmd_train", stop)  # (cli.main imports it from there when called)
    monkeypatch.setattr(peer_lost, "GRACE_S", 0.0)
    monkeypatch.setattr(peer_lost.signal, "signal", lambda *a: None)  # the test process keeps its handlers
    monkeypatch.setattr(peer_lost.time, "sleep", lambda s: print("waited", file=sys.stderr))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert cli.main(["train"]) == 2  # the documented code on every rank
    err = capsys.readouterr().err
    assert err.startswith("waited") != said  # local rank 0 says it at once; the others wait for it to
    assert err.count("meshforge: error: non-finite loss") == 1  # said by a quiet rank only if rank 0 never did


def test_a_report_that_cannot_be_written_leaves_no_file(tmp_path, corpus, monkeypatch, capsys):
    from meshforge.cli.train import write_run_report
    from meshforge.report import run_report

    cfg = tiny_config(tmp_path / "run", corpus)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text("")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    write_run_report(cfg)
    monkeypatch.undo()
    assert "note: report.html skipped" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["events.jsonl"]  # no 0-byte report, no .part
    monkeypatch.setattr(run_report, "build_html", lambda runs: "<html></html>")
    run_report.write_report([tmp_path / "run"])
    assert (tmp_path / "run" / "report.html").read_text() == "<html></html>"


def test_the_run_exit_code_is_the_cause_not_the_killed_peers():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from meshforge.launch.local import exit_code_of

    def failed(*codes):
        fails = {
            r: ProcessFailure(local_rank=r, pid=r + 1, exitcode=c, error_file="/nonexistent")
            for r, c in enumerate(codes)
        }
        return exit_code_of(ChildFailedError("meshforge", fails))

    assert failed(-15, 2) == 2 and failed(1, 2) == 2 and failed(3, 1) == 3 and failed(1, -9) == 1


def test_a_rank_whose_peer_went_away_says_one_line(monkeypatch, capsys):
    from meshforge.health.peer_lost import is_peer_lost, say_peer_lost

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    e = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:5555")
    assert is_peer_lost(e) and not is_peer_lost(ValueError("shape mismatch"))
    assert say_peer_lost(e) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshforge: rank 1 stopped: another rank of the run went away")
    assert "pair.cc" not in err and "Connection closed" not in err  # named, not quoted


# -- end to end (2 gloo ranks) ----------------------------------------------------------------------------


def _alive(run_dir: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"run.dir={run_dir}"], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "process_group"])
def test_killing_the_launcher_kills_its_ranks(tmp_path, corpus, target):
    d = tmp_path / "run"
    args = cli_args(tiny_overrides(d, corpus, **{"train.steps": 100000, "train.eval_batches": 0}))
    cmd = [sys.executable, "-m", "meshforge", "train", "--nproc", "2", *args]
    launcher = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (d / "events.jsonl").exists() or len(_alive(d)) < 3:  # the launcher and both ranks
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        ranks = [p for p in _alive(d) if p != launcher.pid]
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGKILL)
        else:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        for _ in range(200):  # up to 20 s; they go within a second (PR_SET_PDEATHSIG)
            if not _alive(d):
                break
            time.sleep(0.1)
        assert not _alive(d), f"ranks {ranks} outlived their launcher"
    finally:
        for p in _alive(d):
            os.kill(p, signal.SIGKILL)


@pytest.fixture
def tmpfs(tmp_path):
    """A 3 MiB tmpfs (skipped where mounting is not permitted)."""
    m = tmp_path / "tmpfs"
    m.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(m)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs is not permitted here; the shim tests above cover the messages")
    yield m
    subprocess.run(["umount", "-l", str(m)], check=False)


@pytest.mark.slow
def test_a_full_disk_mid_run_stops_cleanly_and_a_read_only_one_is_refused(tmpfs, corpus):
    d = tmpfs / "run"  # one checkpoint and the final weights fit (checked up front); a second checkpoint does not
    extra = {"checkpoint.interval": 2, "checkpoint.keep": 3, "train.eval_batches": 0}
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(d, corpus, **extra)), timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "meshforge: error: cannot write" in r.stderr and "No space left on device (ENOSPC)" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("meshforge: error:") == 1, r.stderr[-3000:]
    events = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "failure" and "ENOSPC" in e["error"] for e in events)
    ckpts = d / "checkpoints"
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-step-")]  # the partial save is gone
    from meshforge.checkpoint import store

    assert [c.step for c in store.list_complete(ckpts)] == [2]
    store.verify(ckpts / "step-00000002")  # the earlier checkpoint is intact
    report = d / "report.html"
    assert not report.exists() or report.stat().st_size > 0
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    r = run_cli("train", "--nproc", "2", *cli_args(tiny_overrides(tmpfs / "new", corpus)), timeout=120)
    assert r.returncode == 2 and "Read-only file system (EROFS)" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("train", *cli_args(tiny_overrides(d, corpus)), timeout=120)  # into the existing run: the lock file
    assert r.returncode == 2 and "(EROFS)" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,extra,code",
    [
        ("nan:rank=1:step=3", {"health.on_nonfinite": "stop"}, 2),
        ("hang:rank=0:step=4", {"health.hang_timeout_s": 3.0}, 3),
    ],
    ids=["nan-stop", "hang-no-restarts"],
)
def test_exit_codes_as_documented_and_no_transport_traceback(tmp_path, corpus, fault, extra, code):
    d = tmp_path / "run"
    over = tiny_overrides(d, corpus, **{"optim.warmup_steps": 0, "train.eval_batches": 0, **extra})
    r = run_cli("train", "--nproc", "2", *cli_args(over), env={"MESHFORGE_FAULT": fault}, timeout=300)
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Connection closed by peer" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("meshforge: error:") == (code == 2), r.stderr[-3000:]  # a health stop: said once
