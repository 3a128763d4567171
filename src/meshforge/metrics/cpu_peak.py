"""A CPU's peak FLOP/s: measured, cached with its age and the machine it was measured on, and
held against what a run reaches; and this CPU's whole compute profile, for the planner.

A CPU has no datasheet figure meshforge can trust, so its peak is the best matmul throughput
a short calibration shows (``calibrate_cpu_peak``), cached in ``~/.cache/meshforge/cpu_peak.json``
per CPU, thread count, torch version and dtype. Each entry records when it was measured, on
which machine (a fingerprint: host, CPU model, core count) and the load average then; one older
than ``MAX_AGE_S`` or from another machine is measured again. A figure measured while other
work held the cores can be far too low, and then every later run would report an MFU above
100%, which is impossible: ``recheck`` is what a run calls when it beats its peak. It measures
once more; if the run still beats that, the peak becomes ``estimated_cpu_peak`` -- cores x
clock x FLOPs per cycle of the widest vector unit, a datasheet-style ceiling (docs/metrics.md)
-- and the run says which it used.

``cpu_profile(threads)`` is the planner's picture of this CPU without ``meshforge calibrate``: the
compute figures calibrate measures (metrics/compute_profile.py: the matmul peaks and their size
curve, the attention core's share, memory bandwidth, a block's element-wise work and its fixed
per-op costs, the optimizer's) with ``threads`` threads, measured once (about ten seconds) and
cached like the peak, per machine, thread count and torch version.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import time
from pathlib import Path

import torch

from meshforge.data.prepare import default_cache_dir

MAX_AGE_S = 30 * 24 * 3600  # a measurement older than this is taken again
VERSION = 2
DEFAULT_GHZ = 3.0  # the clock assumed where the system does not say


def cache_file() -> Path:
    return default_cache_dir() / "cpu_peak.json"


def calibrate_cpu_peak(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5) -> float:
    """Best observed matmul FLOP/s on this CPU with the current thread count.

    Starts small and grows the matrices only while one matmul stays cheap, so a CPU
    that is slow in a dtype (bf16 without native support) is measured in well under a second.
    """
    n = 128
    while n < size:
        a = torch.randn(2 * n, 2 * n, dtype=dtype)
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > seconds / 20:
            break
        n *= 2
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = 0.0
    end = time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < end:  # one timed call at least: a descheduled process
        # can pass ``end`` before its first (it returned 0 FLOP/s under the suite's load)
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def _cpuinfo() -> tuple[str, str, float]:
    """(CPU model name, its flags, clock in GHz) from /proc/cpuinfo where there is one."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), "", DEFAULT_GHZ
    fields: dict[str, str] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        fields.setdefault(k.strip().lower(), v.strip())
    ghz = max(_float(fields.get("cpu mhz")) / 1e3, _float(_read_text(_MAX_FREQ)) / 1e6)  # MHz; kHz
    flags = fields.get("flags", fields.get("features", ""))
    return fields.get("model name", platform.machine()), flags, ghz if ghz > 0 else DEFAULT_GHZ


_MAX_FREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _float(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def machine_fingerprint() -> str:
    """This machine as a CPU peak depends on it: host, CPU model and core count."""
    model, _, _ = _cpuinfo()
    raw = f"{socket.gethostname()}|{model}|{os.cpu_count()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def flops_per_cycle(flags: str, machine: str, bf16: bool) -> int:
    """Peak FLOPs per cycle per core of the widest vector unit (two FMA pipes)."""
    f = set(flags.split())
    if bf16 and "amx_bf16" in f:
        return 1024
    if bf16 and "avx512_bf16" in f:
        return 128
    if "avx512f" in f:
        return 64
    if "avx2" in f and "fma" in f:
        return 32
    if machine.lower() in ("aarch64", "arm64"):
        return 16  # two 128-bit NEON FMA pipes
    return 8


def estimated_cpu_peak(precision: str) -> float:
    """Threads x clock x FLOPs per cycle: the ceiling a datasheet would give (docs/metrics.md)."""
    _, flags, ghz = _cpuinfo()
    per_cycle = flops_per_cycle(flags, platform.machine(), precision == "bf16")
    return torch.get_num_threads() * ghz * 1e9 * per_cycle


def _key(dtype: torch.dtype) -> str:
    return f"{platform.processor() or platform.machine()}|threads={torch.get_num_threads()}|{torch.__version__}|{dtype}"


def _read() -> dict:
    try:
        cache = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return cache.get("entries", {}) if isinstance(cache, dict) and cache.get("version") == VERSION else {}


def _store(key: str, flops: float) -> None:
    _store_entry(key, {"flops": flops})


def _store_entry(key: str, fields: dict) -> None:
    entries = _read()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    entries[key] = {**fields, "measured_at": time.time(), "machine": machine_fingerprint(), "loadavg": load}
    f = cache_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, "entries": entries}, indent=1))
        tmp.replace(f)
    except OSError:
        pass  # a read-only home only costs a recalibration next time


def _dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def cpu_peak_flops(precision: str) -> float:
    """The cached peak for ``precision``, measured (again) when missing, older than MAX_AGE_S or
    measured on another machine."""
    dtype = _dtype(precision)
    key = _key(dtype)
    entry = _read().get(key)
    fresh = (
        isinstance(entry, dict)
        and isinstance(entry.get("flops"), (int, float))
        and entry["flops"] > 0
        and time.time() - float(entry.get("measured_at", 0)) < MAX_AGE_S
        and entry.get("machine") == machine_fingerprint()
    )
    if fresh:
        return float(entry["flops"])
    flops = calibrate_cpu_peak(dtype)
    _store(key, flops)
    return flops


def _profile_key(threads: int) -> str:
    return f"profile|{platform.processor() or platform.machine()}|threads={threads}|{torch.__version__}"


def _fresh(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and time.time() - float(entry.get("measured_at", 0)) < MAX_AGE_S
        and entry.get("machine") == machine_fingerprint()
    )


def cpu_profile(threads: int) -> dict:
    """This CPU's compute figures with ``threads`` threads (``compute_profile.compute_profile``'s
    dict: peaks, half, attn, bw, elem, fixed, opt, timing), cached; measured when missing, older
    than MAX_AGE_S or from another machine."""
    key = _profile_key(threads)
    entry = _read().get(key)
    if _fresh(entry) and isinstance(entry.get("profile"), dict):
        return entry["profile"]
    from meshforge.metrics.compute_profile import compute_profile

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prof = compute_profile(torch.device("cpu"), quick=True)
    finally:
        torch.set_num_threads(before)
    _store_entry(key, {"profile": prof})
    return prof


def recheck(precision: str, reached: float) -> tuple[float, str]:
    """A new peak for a run that reached ``reached`` FLOP/s per device, more than its peak:
    measured again (and cached) if that beats the run, else the estimate (never below what the
    run reached). Returns (peak, "measured again" | "estimate")."""
    dtype = _dtype(precision)
    flops = calibrate_cpu_peak(dtype)
    if flops >= reached:
        _store(_key(dtype), flops)
        return flops, "measured again"
    return max(estimated_cpu_peak(precision), reached), "estimate"
