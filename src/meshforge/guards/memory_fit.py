"""The pre-flight fit check: a run that cannot fit in its device's memory is refused before
anything is allocated, with what would make it fit.

One estimate serves both ``meshforge train --dry-run`` and this check (``estimate_run``): the
planner's estimate of exactly the resolved layout, on a hardware profile whose memory is this
machine's (the free memory of the rank's GPU; on a CPU the host RAM available to each rank, or
less where a cgroup or rlimit allows less: guards/host_limits.py), so the planner's own verdict and
overflow text speak of the real device. Without the check an
8B model on a 24 GiB CPU machine is killed by the kernel minutes later with no message, and on
a GPU dies out of memory after its first steps.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.config.run_plan import RunPlan
from meshforge.errors import MeshforgeError
from meshforge.guards.host_limits import Limit, cgroup_limits, rlimits

GIB = 2**30
AVAILABLE_ENV = "MESHFORGE_TEST_AVAILABLE_GIB"  # tests: pretend this many GiB are available (CPU and CUDA)
# The planner's GPU estimate has read 0.81-0.94 of measured peaks (issue 27): below this share of
# the free memory a run is taken to fit; between it and 1 it may not, and the check says so.
WARN_SHARE = 0.8


class FitError(MeshforgeError):
    """The planner's estimate of this run exceeds the device's free memory (exit 2)."""


@dataclass
class DeviceMemory:
    """The memory one rank may use: a GPU's free memory, or its share of the host's available RAM."""

    kind: str  # "cpu" | "cuda"
    name: str  # "CPU" or the GPU's name
    free_gib: float  # free (CUDA) or available (CPU, the whole host's)
    total_gib: float
    ranks: int = 1  # ranks on this host sharing it (CPU)
    limit: Limit | None = None  # CPU: a cgroup or rlimit that leaves a rank less than its share of the RAM
    limit_gib: float = 0.0  # what the planner's estimate for one rank may total under ``limit``

    @property
    def per_rank_gib(self) -> float:
        if self.kind != "cpu":
            return self.free_gib
        return self.limit_gib if self.limit else self.free_gib / self.ranks

    def describe(self) -> str:
        if self.kind == "cpu":
            share = f", {self.free_gib / self.ranks:.1f} GiB for each of {self.ranks} ranks" if self.ranks > 1 else ""
            ram = f"{self.free_gib:.1f} GiB RAM available (of {self.total_gib:.1f} GiB){share}"
            if self.limit:
                return f"CPU, {self.limit_gib:.2f} GiB per rank under {self.limit_text()}; {ram}"
            return f"CPU, {ram}"
        return f"{self.name}, {self.free_gib:.1f} GiB free of {self.total_gib:.1f} GiB"

    def limit_text(self) -> str:
        """The binding limit, its size and what it already counts, e.g. for the refusal."""
        lim = self.limit
        held = "in the cgroup now" if lim.shared else "by this process now and the threads a run starts"
        return f"{lim.name} = {lim.limit / GIB:.2f} GiB ({lim.held / GIB:.2f} GiB held {held})"


def _meminfo(key: str) -> int | None:
    """A /proc/meminfo figure in bytes (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == key:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf(pages: str) -> int:
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def host_memory() -> tuple[float, float]:
    """(available, total) host RAM in GiB: /proc/meminfo's MemAvailable (what can be allocated
    without swapping, page cache included), else sysconf's free pages."""
    total = _meminfo("MemTotal") or _sysconf("SC_PHYS_PAGES")
    avail = _meminfo("MemAvailable") or _sysconf("SC_AVPHYS_PAGES")
    if os.environ.get(AVAILABLE_ENV):
        avail = float(os.environ[AVAILABLE_ENV]) * GIB
    return avail / GIB, max(total, avail) / GIB


def device_memory(cuda: bool, local_rank: int = 0, local_ranks: int = 1) -> DeviceMemory:
    """This rank's device memory. On CPU nothing touches CUDA; on CUDA the rank's own GPU
    (``local_rank`` modulo the visible devices) is asked, which creates its context there."""
    if not cuda:
        avail, total = host_memory()
        ranks = max(1, local_ranks)
        limit, budget = binding_limit(avail / ranks, ranks)
        return DeviceMemory("cpu", "CPU", avail, total, ranks, limit, budget)
    import torch

    index = local_rank % max(1, torch.cuda.device_count())
    free, total = torch.cuda.mem_get_info(index)
    if os.environ.get(AVAILABLE_ENV):
        free = float(os.environ[AVAILABLE_ENV]) * GIB
    return DeviceMemory("cuda", torch.cuda.get_device_name(index), free / GIB, total / GIB)


def binding_limit(ram_per_rank_gib: float, ranks: int) -> tuple[Limit | None, float]:
    """The cgroup or rlimit (guards/host_limits.py) that leaves a rank less than its share of the host's
    available RAM, with what the planner's estimate may total under it (GiB); (None, 0) if none."""
    if os.environ.get(AVAILABLE_ENV):
        return None, 0.0  # a test pretends this much memory: nothing else is read
    import torch

    from meshforge.planner.hardware import get_hardware, preset_for_device

    reserve = int(get_hardware(preset_for_device("cpu")).reserve_gib * GIB)  # the process itself, in the estimate
    limits = [*cgroup_limits(), *rlimits(torch.get_num_threads())]
    tightest = min(limits, key=lambda x: x.budget(ranks, reserve), default=None)
    if tightest is None or tightest.budget(ranks, reserve) / GIB >= ram_per_rank_gib:
        return None, 0.0
    return tightest, tightest.budget(ranks, reserve) / GIB


@dataclass
class RunEstimate:
    """The planner's estimate of one run's layout (None, with ``error``, where it has none)."""

    estimate: Any  # planner.estimate.Estimate | None
    hardware: str  # the planner's profile name, e.g. "cpu", "h100-sxm"
    ranks: int  # ranks the estimate is for (one DiLoCo island's)
    islands: int
    error: str = ""


def estimate_run(plan: RunPlan, mem: DeviceMemory) -> RunEstimate:
    """The planner's estimate of exactly this run plan on its world, on a profile of this machine
    (its memory replaced by ``mem``'s per-rank figure; a GPU's host RAM too)."""
    from meshforge.config import to_toml
    from meshforge.planner.hardware import get_hardware, preset_for_device, to_json
    from meshforge.planner.plan import parse_plan_args, plan_from_args

    world = plan.world.size
    m = plan.layout.islands
    hw = get_hardware(preset_for_device("cpu" if mem.kind == "cpu" else mem.name))
    hw.hbm_gib = mem.per_rank_gib
    if mem.kind == "cuda" and plan.layout.offload == "cpu":
        hw.host_mem_gib = host_memory()[0]  # the node's ranks keep their offloaded state here
    # DiLoCo: the planner estimates one island's layout, on its share of the global batch
    island = dataclasses.replace(plan.train, global_batch_size=plan.train.global_batch_size // m)
    with tempfile.TemporaryDirectory() as d:
        path, profile = Path(d) / "config.toml", Path(d) / "hardware.json"
        path.write_text(to_toml(plan.config if m == 1 else dataclasses.replace(plan.config, train=island)))
        profile.write_text(to_json(hw))
        args = ["--config", str(path), "--gpus", str(world // m), "--hardware", str(profile)]
        try:
            pl = plan_from_args(parse_plan_args(args))
        except MeshforgeError as e:
            return RunEstimate(None, hw.name, world // m, m, str(e))
    e = pl.results[0] if pl.results else (pl.results.refused[0] if pl.results.refused else None)
    return RunEstimate(e, hw.name, world // m, m, "" if e else "no estimate for this layout")


def check_fit(plan: RunPlan, local_rank: int = 0, local_ranks: int = 1) -> RunEstimate | None:
    """Refuse (FitError) a run plan whose estimate exceeds this rank's memory; warn where it is
    within the planner's uncertainty. ``train.skip_memory_check = true`` skips it."""
    if plan.train.skip_memory_check:
        return None
    world = plan.world.size
    mem = device_memory(plan.world.device == "cuda", local_rank, local_ranks)
    try:
        est = estimate_run(plan, mem)
    except Exception as err:  # noqa: BLE001 - a planner bug must not stop a run it cannot price
        print(f"meshforge: warning: memory check skipped (the planner failed: {err!r})", file=sys.stderr)
        return None
    e = est.estimate
    if e is None:
        return est  # the planner cannot price this layout: nothing to hold it against
    need = e.memory["total"]
    if not e.fits:
        raise FitError(refusal(plan, world, mem, est))
    if need > WARN_SHARE * mem.per_rank_gib:
        why = (
            "its estimate can be 10-20% low"
            if mem.kind == "cuda"
            else "its share for Python, torch and threads is fixed"
        )
        print(
            f"meshforge: warning: the planner estimates {need:.2f} GiB per rank, over {WARN_SHARE:.0%} of the "
            f"{mem.per_rank_gib:.2f} GiB this rank has ({mem.describe()}); {why}, so this run may still run out of "
            "memory",
            file=sys.stderr,
        )
    return est


def refusal(plan: RunPlan, world: int, mem: DeviceMemory, est: RunEstimate) -> str:
    """The paragraph a refused run prints: the estimate, the free memory, and the fixes."""
    e = est.estimate
    need = e.memory["total"]
    shared = f", {mem.per_rank_gib:.1f} GiB for each of {mem.ranks} ranks" if mem.ranks > 1 else ""
    room = f"{mem.free_gib:.1f} GiB {'RAM available on this CPU' if mem.kind == 'cpu' else 'free on ' + mem.name}"
    if mem.limit:
        room = f"{mem.limit_gib:.2f} GiB a rank may use under {mem.limit_text()}"
        shared = ""
    head = (
        f"this run cannot fit: the planner estimates {need:.2f} GiB per rank, more than the {room}{shared} "
        f"({e.overflow}); it would be killed or run out of memory later. To make it fit:"
    )
    return "\n".join([head, *(f"  - {f}" for f in fixes(plan, world, mem, e)), SKIP_LINE])


SKIP_LINE = "or set train.skip_memory_check = true (--train.skip_memory_check) to start it anyway"


def fixes(plan: RunPlan, world: int, mem: DeviceMemory, e: Any) -> list[str]:
    """What would shrink this run's memory, for the settings it does not already use."""
    t, out = plan.train, []
    lay = e.layout
    if mem.limit:  # the limit raised by what the estimate lacks (a shared one: for every rank)
        short = (e.memory["total"] - mem.limit_gib) * (mem.ranks if mem.limit.shared else 1)
        out.append(mem.limit.raise_to(mem.limit.limit + short * GIB))
    if plan.layout.activation_checkpoint != "full":
        out.append("activation checkpointing: --train.activation_checkpoint=full (recompute each block's activations)")
    if lay.micro_batch_size > 1:
        mb = lay.micro_batch_size
        smaller = next(d for d in range(max(1, mb // 4), 0, -1) if mb % d == 0)  # still divides the batch
        out.append(f"a smaller micro-batch: --train.micro_batch_size={smaller} (is {mb})")
    if mem.kind == "cuda" and plan.layout.offload != "cpu":
        out.append("CPU offload: --parallel.offload=cpu (parameters, gradients and optimizer state in host RAM)")
    if mem.kind == "cpu" and t.precision == "fp32":
        out.append("bf16 weights: --train.precision=bf16 (half of fp32's parameter and activation bytes)")
    if mem.kind == "cpu" and mem.ranks > 1:
        out.append(f"fewer ranks on this host (--nproc): {mem.ranks} ranks each hold their share in one RAM")
    more = "more GPUs" if mem.kind == "cuda" else "more machines, or GPUs"
    out.append(f"{more}, with the state sharded (--parallel.zero_stage=3, tp, pp)")
    out.append(f"a layout from the planner: {plan_command(plan, world, mem, e)}")
    return out


def plan_command(plan: RunPlan, world: int, mem: DeviceMemory, e: Any) -> str:
    """The exact ``meshforge plan`` command for this model, batch and precision."""
    from meshforge.models.presets import PRESETS
    from meshforge.planner.hardware import preset_for_device

    a = plan.shape
    if plan.model.preset in PRESETS and a == PRESETS[plan.model.preset]:
        model = f"--model {plan.model.preset}"
    else:  # a shape of its own: the plan flags that give it
        model = (
            f"--layers {a.layers} --hidden {a.hidden} --heads {a.heads} --kv-heads {a.kv_heads} "
            f"--ffn-hidden {a.ffn_hidden} --vocab {a.vocab_size}"
        )
        if a.num_experts:
            model += f" --experts {a.num_experts} --top-k {a.experts_per_token}"
    gpu = preset_for_device(mem.name) if mem.kind == "cuda" else "h100-sxm"
    need_gpus = 1
    while need_gpus < 8 * 1024 and e.memory["total"] / need_gpus > 0.9 * (mem.total_gib if mem.kind == "cuda" else 80):
        need_gpus *= 2
    gpus = max(need_gpus, world * 2 if mem.kind == "cuda" else need_gpus)
    precision = plan.train.precision if mem.kind == "cuda" and plan.train.precision in ("fp32", "fp8") else "bf16"
    return (
        f"meshforge plan {model} --seq-len {plan.train.seq_len} --global-batch {plan.train.global_batch_size} "
        f"--precision {precision} --gpu {gpu} --gpus {gpus}"
    )
