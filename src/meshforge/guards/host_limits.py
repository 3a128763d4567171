"""The memory limits a CPU process runs under besides the host's free RAM: its cgroup's (v2
``memory.max``, v1 ``memory.limit_in_bytes``) and its own resource limits (``RLIMIT_DATA``,
``RLIMIT_AS``). A container or a ``ulimit`` can allow far less than ``MemAvailable`` says, and a
run the fit check passed against the host's RAM then dies with a MemoryError (or the kernel's
OOM kill) in its first steps; the fit check holds the planner's estimate against the smallest.

An rlimit counts this process from its start: Python and torch already hold part of it when the
check runs (``VmData``/``VmSize``), and the threads a run starts add their stacks (and, for the
address space, each thread's 64 MiB malloc arena) that no estimate of tensors sees. The
planner's CPU ``reserve`` stands for the process itself; where the process holds more than it,
the excess is taken off the limit. Linux only (the figures come from /proc); elsewhere no limit
is read and the host's RAM is the only one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
THREAD_STACK = 8 * MIB  # glibc's default thread stack (RLIMIT_STACK's usual 8 MiB): private writable memory
MALLOC_ARENA = 64 * MIB  # the heap glibc reserves for each thread's own malloc arena (address space only)
RUN_THREADS = 4  # threads a run starts besides torch's (metrics writer, watchdog, ...): measured on CPU runs
UNLIMITED = 2**60  # a cgroup without a limit reads "max" (v2) or 2**63 - 4096 (v1)


@dataclass(frozen=True)
class Limit:
    """One limit on this process's memory, in bytes. ``held``: what it counts already (an rlimit:
    this process now plus the stacks and arenas of the threads it will start; a cgroup: every
    process in it, less reclaimable page cache). ``shared``: the host's local ranks share it."""

    name: str  # e.g. "RLIMIT_DATA (ulimit -d)", "cgroup v2 memory.max of /job"
    limit: int
    held: int
    shared: bool
    fix: str  # how to raise it to {gib} GiB ({kib} KiB)

    def raise_to(self, need: float) -> str:
        """The fix that lets ``need`` bytes through: this limit raised to at least that."""
        return self.fix.format(gib=f"{need / 2**30:.2f}", kib=-(-int(need) // 1024))

    def budget(self, ranks: int, reserve: int) -> float:
        """Bytes the planner's estimate for one rank may total under this limit; the estimate
        counts ``reserve`` bytes for the process itself (Python, torch, allocator slack)."""
        if self.shared:
            return (self.limit - self.held) / max(1, ranks)
        return self.limit - max(0, self.held - reserve)


def _status() -> dict[str, int]:
    """/proc/self/status's Vm* figures in bytes (empty where there is no /proc)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (x.partition(":") for x in lines) if k.startswith("Vm")}


def rlimits(threads: int) -> list[Limit]:
    """This process's soft RLIMIT_DATA and RLIMIT_AS, where set: RLIMIT_DATA counts private
    writable memory (``VmData``: the heap, tensors, thread stacks), RLIMIT_AS every mapping
    (``VmSize``: also libraries and the arenas' reserved address space)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: no rlimits
        return []
    status, out = _status(), []
    started = threads + RUN_THREADS
    kinds = (
        ("RLIMIT_DATA", "ulimit -d", "VmData", THREAD_STACK),
        ("RLIMIT_AS", "ulimit -v", "VmSize", THREAD_STACK + MALLOC_ARENA),
    )
    for name, shell, key, per_thread in kinds:
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft == resource.RLIM_INFINITY or key not in status:
            continue
        held = status[key] + started * per_thread
        fix = f"raise {name} to at least {{gib}} GiB: `{shell} {{kib}}` in the shell (or job) that starts the run"
        out.append(Limit(f"{name} ({shell})", soft, held, False, fix))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _inactive_file(stat: Path) -> int:
    """Reclaimable page cache in a cgroup's memory.stat (what the kernel frees before an OOM kill)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0
    fields = dict(x.split()[:2] for x in lines if len(x.split()) >= 2)
    value = fields.get("total_inactive_file", fields.get("inactive_file", "0"))
    return int(value) if value.isdigit() else 0


def _group_limit(d: Path, v2: bool, rel: str) -> Limit | None:
    """The limit of one cgroup directory, or None where it has none (or none can be read)."""
    limit = _read_int(d / ("memory.max" if v2 else "memory.limit_in_bytes"))
    usage = _read_int(d / ("memory.current" if v2 else "memory.usage_in_bytes"))
    if limit is None or usage is None or limit >= UNLIMITED:
        return None
    held = max(0, usage - _inactive_file(d / "memory.stat"))
    name = f"cgroup {'v2 memory.max' if v2 else 'v1 memory.limit_in_bytes'} of {rel}"
    safe = rel.replace("{", "{{").replace("}", "}}")  # the fix is a format string
    fix = (
        f"a memory limit of at least {{gib}} GiB for cgroup {safe} (docker --memory, Kubernetes limits.memory), "
        "or fewer other processes in it"
    )
    return Limit(name, limit, held, True, fix)


def cgroup_limits(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> list[Limit]:
    """The memory limits of this process's cgroup and of every cgroup above it (v2 and v1)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hier == "0" and not controllers
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = (root if (root / "cgroup.controllers").exists() else root / "unified") if v2 else root / "memory"
        rel = Path(path.lstrip("/"))
        for parent in [rel, *rel.parents]:
            found = _group_limit(base / parent, v2, "/" + str(parent) if parent.parts else "/")
            out += [found] if found else []
    return out
