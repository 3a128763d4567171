"""What CPU offload (``parallel.offload = "cpu"``) changes in the planner's memory and time.

As meshforge runs it (parallel/data/apply.py), FSDP2's CPUOffloadPolicy keeps the whole
sharded state on the host: the fp32 parameter shard (pinned; the master copy), the fp32
gradient shard (pinned) and AdamW's two moments, i.e. what ``allocated_state_bytes`` counts
for ZeRO-2/3 (16 bytes x Ψ / N). What stays on the device, per unit (block) and step:

- the unit's gathered parameters, as without offload (the running and the prefetched unit
  under ZeRO-3, all of them from forward to backward under ZeRO-2: counted under buffers);
- staging: before a unit's all-gather its fp32 shard is copied to the device and cast there
  (``FSDPParam.all_gather_inputs``), and after its reduce-scatter the fp32 gradient shard
  waits on the device for its copy to the host (``foreach_reduce``); with one unit
  prefetched, up to two of each: 4 x 4 bytes x (unit parameters) / N.

Host-link traffic per step: every all-gather first copies the fp32 shard up (4Ψ/N bytes; one
gather per micro-batch under ZeRO-2, two under ZeRO-3, as in the data-parallel time), and
the reduced gradient shard comes down once per step (4Ψ/N; gradients are reduced on the last
micro-batch), at ``Hardware.host_link_bw``. The optimizer step runs on the CPU: clipping reads
the gradients (4 bytes per parameter) and fused AdamW reads parameters, gradients and both
moments and writes parameters and moments (28): 32 bytes per parameter, twice the host state,
at ``Hardware.host_mem_bw`` (the node's host memory bandwidth shared by its GPUs' ranks; the
launcher gives each rank its share of the cores).
"""

from __future__ import annotations

from meshforge.errors import ConfigError
from meshforge.planner.hardware import GIB, Hardware

STAGING_COPIES = 4  # fp32 shards in flight: two units' parameters (running + prefetched), two units' gradients


def host_state_bytes(states: dict[str, float]) -> dict[str, float]:
    """The model states offload moves to host memory: all of FSDP2's sharded state, as
    ``allocated_state_bytes`` counts it (params, grads, optimizer)."""
    return {k: states[k] for k in ("params", "grads", "optimizer")}


def host_memory_gib(states: dict[str, float], ranks_per_node: int) -> dict[str, float]:
    """Host memory per GPU (GiB, by part) and for the node's ranks (``per_node``)."""
    out = {k: v / GIB for k, v in host_state_bytes(states).items()}
    out["total"] = sum(out.values())
    out["per_node"] = out["total"] * ranks_per_node
    return out


def staging_bytes(unit_params: float, n: int) -> float:
    """Device bytes offload adds: fp32 shard copies of the units in flight (module doc)."""
    return STAGING_COPIES * 4 * unit_params / n


def link_bytes(psi: float, n: int, zero_stage: int, num_microbatches: int) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes per GPU and step: the fp32 parameter shard before
    every all-gather, the fp32 gradient shard once."""
    gathers = (2 if zero_stage == 3 else 1) * num_microbatches
    return gathers * 4 * psi / n, 4 * psi / n


def link_seconds(psi: float, n: int, zero_stage: int, num_microbatches: int, hw: Hardware) -> float:
    """Time of the host-link copies of one step, both directions (before any overlap)."""
    _check_host(hw)
    h2d, d2h = link_bytes(psi, n, zero_stage, num_microbatches)
    return (h2d + d2h) / hw.host_link_bw


def cpu_optimizer_seconds(states: dict[str, float], hw: Hardware) -> float:
    """The CPU optimizer step (clipping + fused AdamW): twice the host state over the host
    memory bandwidth (module doc)."""
    _check_host(hw)
    return 2 * sum(host_state_bytes(states).values()) / hw.host_mem_bw


def can_offload(hw: Hardware) -> bool:
    """Whether this hardware has a host to offload to (a CPU's state already lives there)."""
    return hw.host_link_bw > 0 and hw.host_mem_bw > 0


def _check_host(hw: Hardware) -> None:
    if not can_offload(hw):
        raise ConfigError(
            f"CPU offload on {hw.name}: no host-side figures (host_link_bw, host_mem_bw); on a CPU the state already "
            "lives in host memory"
        )
