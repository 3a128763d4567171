"""The memory limits a CPU run is held against besides the host's RAM (meshforge/guards/host_limits.py):
cgroup v2 and v1 limits read from a cgroup tree (built here), rlimits through a patched
``resource.getrlimit``, and the fit check naming the limit that refuses a run and how to raise
it. The real limits, in a child process at the edge of the estimate: tests/integration/test_fit_rlimit.py."""

import resource

import pytest

from conftest import tiny_config
from meshforge.guards import host_limits
from meshforge.guards import memory_fit as fit
from meshforge.guards.host_limits import RUN_THREADS, THREAD_STACK, Limit, cgroup_limits, rlimits
from meshforge.guards.memory_fit import AVAILABLE_ENV, FitError, check_fit, device_memory
from meshforge.resolve import resolve

GIB, MIB = 2**30, 2**20


def _group(d, limit: str, usage: int, inactive: int, v2: bool = True) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(limit + "\n")
    (d / ("memory.current" if v2 else "memory.usage_in_bytes")).write_text(f"{usage}\n")
    stat = f"anon 1\ninactive_file {inactive}\n" if v2 else f"cache 5\ntotal_inactive_file {inactive}\n"
    (d / "memory.stat").write_text(stat)


def test_cgroup_v2_limit_less_its_usage_without_reclaimable_cache(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    (root).mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    _group(root / "job" / "step", "max", 5 * GIB, 0)  # no limit of its own
    _group(root / "job", str(2 * GIB), GIB, 256 * MIB)
    proc.write_text("0::/job/step\n")
    (got,) = cgroup_limits(root, proc)
    assert got.name == "cgroup v2 memory.max of /job" and got.shared
    assert (got.limit, got.held) == (2 * GIB, GIB - 256 * MIB)
    assert got.budget(ranks=2, reserve=GIB // 2) == pytest.approx((GIB + 256 * MIB) / 2)  # the ranks share it
    assert "at least 3.00 GiB for cgroup /job" in got.raise_to(3 * GIB)


def test_cgroup_v1_reads_every_level_and_skips_unlimited(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _group(root / "memory" / "a" / "b", str(8 * GIB), GIB, 0, v2=False)
    _group(root / "memory" / "a", str(4 * GIB), 3 * GIB, GIB, v2=False)
    _group(root / "memory", str(2**63 - 4096), 9 * GIB, 0, v2=False)  # v1's "no limit"
    proc.write_text("5:cpu:/a/b\n4:memory:/a/b\n0::/\n")  # a v2 line without the memory controller mounted
    got = {x.name: x for x in cgroup_limits(root, proc)}
    assert set(got) == {"cgroup v1 memory.limit_in_bytes of /a/b", "cgroup v1 memory.limit_in_bytes of /a"}
    assert got["cgroup v1 memory.limit_in_bytes of /a"].held == 2 * GIB  # usage less total_inactive_file
    assert cgroup_limits(root, tmp_path / "missing") == []


def _fake_rlimits(monkeypatch, data: int, space: int) -> None:
    inf = resource.RLIM_INFINITY
    values = {resource.RLIMIT_DATA: (data, inf), resource.RLIMIT_AS: (space, inf)}
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda r: values.get(r) or real(r))


def test_rlimits_count_what_the_process_holds_and_its_threads_will(monkeypatch):
    _fake_rlimits(monkeypatch, 3 * GIB, resource.RLIM_INFINITY)
    monkeypatch.setattr(host_limits, "_status", lambda: {"VmData": 300 * MIB, "VmSize": 900 * MIB})
    (data,) = rlimits(threads=2)
    assert data.name == "RLIMIT_DATA (ulimit -d)" and not data.shared
    assert data.held == 300 * MIB + (2 + RUN_THREADS) * THREAD_STACK
    assert data.budget(ranks=4, reserve=GIB) == 3 * GIB  # what it holds fits in the estimate's reserve; per process
    assert data.budget(ranks=1, reserve=256 * MIB) == 3 * GIB - (data.held - 256 * MIB)
    assert "`ulimit -d 2097152`" in data.raise_to(2 * GIB)
    _fake_rlimits(monkeypatch, resource.RLIM_INFINITY, 4 * GIB)
    (space,) = rlimits(threads=2)
    assert space.name == "RLIMIT_AS (ulimit -v)" and space.held > 900 * MIB + 6 * 64 * MIB  # stacks and arenas
    monkeypatch.setattr(host_limits, "_status", lambda: {})  # no /proc: nothing to measure, no limit claimed
    assert rlimits(threads=2) == []


def _limits(monkeypatch, *limits: Limit) -> None:
    monkeypatch.delenv(AVAILABLE_ENV, raising=False)
    monkeypatch.setattr(fit, "cgroup_limits", lambda: [x for x in limits if x.shared])
    monkeypatch.setattr(fit, "rlimits", lambda threads: [x for x in limits if not x.shared])


def test_the_tightest_limit_refuses_and_its_fix_comes_first(tmp_path, corpus, monkeypatch):
    plan = resolve(tiny_config(tmp_path / "run", corpus), 1)
    need = fit.estimate_run(plan, device_memory(False)).estimate.memory["total"]
    data = Limit("RLIMIT_DATA (ulimit -d)", int(0.9 * need * GIB), 0, False, "raise it to {gib} GiB ({kib} KiB)")
    group = Limit("cgroup v2 memory.max of /job", 64 * GIB, GIB, True, "cgroup to {gib} GiB")
    _limits(monkeypatch, data, group)
    mem = device_memory(False)
    assert mem.limit is data and mem.per_rank_gib == pytest.approx(0.9 * need, rel=1e-6)
    assert "under RLIMIT_DATA (ulimit -d)" in mem.describe()
    with pytest.raises(FitError) as e:
        check_fit(plan)
    msg = str(e.value)
    assert (
        f"estimates {need:.2f} GiB per rank, more than the {0.9 * need:.2f} GiB a rank may use under RLIMIT_DATA" in msg
    )
    assert msg.split("To make it fit:\n")[1].startswith(f"  - raise it to {need:.2f} GiB")
    _limits(monkeypatch, Limit("RLIMIT_DATA (ulimit -d)", int(1.1 * need * GIB), 0, False, "x"))
    assert check_fit(plan) is not None  # above the estimate: starts


def test_a_limit_above_the_ram_or_a_pretended_amount_leaves_the_ram_in_charge(tmp_path, corpus, monkeypatch):
    _limits(monkeypatch, Limit("RLIMIT_DATA (ulimit -d)", 2**50, 0, False, "x"))
    assert device_memory(False).limit is None and "RAM available" in device_memory(False).describe()
    _limits(monkeypatch, Limit("RLIMIT_DATA (ulimit -d)", MIB, 0, False, "x"))
    monkeypatch.setenv(AVAILABLE_ENV, "12")  # a test's pretended memory replaces every reading
    assert device_memory(False).limit is None and device_memory(False).per_rank_gib == 12
