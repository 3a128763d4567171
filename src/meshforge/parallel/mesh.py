"""The device mesh: every layout is a named N-D mesh of ranks.

Dimensions, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. Tensor
parallel is innermost so its ranks are neighbours (the same node's fast links); pipeline
is outermost because its point-to-point traffic is the lightest. Flattened sub-meshes
give later axes the groups they need:

- ``dp``          = dp_replicate x dp_shard: the data-parallel ranks (the sampler's slices)
- ``dp_shard_cp`` = dp_shard x cp: what FSDP shards parameters over
- ``dp_cp``       = dp_replicate x dp_shard x cp: the ranks that average the loss

One process per device. Under torchrun (or ``meshforge train --nproc N``) the ranks find
each other through the RANK / WORLD_SIZE / MASTER_ADDR environment; started directly,
meshforge is a world of one and needs no process group at all.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.config import Config, ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class Mesh:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    degrees: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMS, 1))
    device_mesh: DeviceMesh | None = None
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    def submesh(self, name: str) -> DeviceMesh:
        """A named dimension or flattened sub-mesh (see module docstring)."""
        assert self.device_mesh is not None, "a world of one has no mesh"
        return self.flattened[name] if name in self.flattened else self.device_mesh[name]

    def slice(self, dims: tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh over several dimensions, flattened ones allowed (e.g. ("dp", "cp"))."""
        if len(dims) == 1:
            return self.submesh(dims[0])
        assert self.device_mesh is not None, "a world of one has no mesh"
        with warnings.catch_warnings():
            # PyTorch warns that slicing a flattened dimension from the root may go away; it is
            # the only public way to combine one with another dimension, so keep it in one place.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.device_mesh[dims]

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.submesh(name).get_group() if self.device_mesh is not None else None

    def coordinate(self, name: str) -> int:
        return self.submesh(name).get_local_rank() if self.device_mesh is not None else 0

    def groups_by_axis(self) -> dict[dist.ProcessGroup, str]:
        """Process group -> axis name, for attributing communication (size-1 axes left out)."""
        out: dict[dist.ProcessGroup, str] = {}
        if self.device_mesh is None:
            return out
        for name in (*DIMS, *FLATTENED):
            sub = self.submesh(name)
            if sub.size() > 1:
                out.setdefault(sub.get_group(), name)
        return out


def resolve_degrees(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """Mesh degrees with a -1 inferred; refuses products that do not match the world size."""
    degrees = {k: getattr(p, k) for k in DIMS}
    for k, v in degrees.items():
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k} = {v} must be >= 1 (or -1 to infer it)")
    free = [k for k, v in degrees.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"only one parallel degree may be -1, got {', '.join('parallel.' + k for k in free)}")
    known = 1
    for v in degrees.values():
        known *= v if v > 0 else 1
    shown = " x ".join(f"{k}={v}" for k, v in degrees.items())
    if free:
        if world_size % known:
            raise ConfigError(
                f"parallel degrees {shown}: world size {world_size} is not divisible by the fixed degrees' "
                f"product {known}; use a world size that is a multiple of {known} or change the degrees"
            )
        degrees[free[0]] = world_size // known
    elif known != world_size:
        fix = world_size // (known // p.dp_shard) if world_size % (known // p.dp_shard) == 0 else None
        hint = f"set parallel.dp_shard = {fix}" if fix else "make their product equal the world size"
        raise ConfigError(
            f"parallel degrees {shown} multiply to {known}, not the world size {world_size}; "
            f"set parallel.dp_shard = -1 to infer it, or {hint}"
        )
    return degrees


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device = 'cuda' but no CUDA device is visible; use train.device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys scoped to this attempt of an elastic run.

    After a failure the elastic agent restarts the ranks against the same store, which still
    holds the dead attempt's addresses; without a fresh prefix the new ranks try to connect
    to them and time out ("connectFullMesh failed ... Connection refused").
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"meshforge/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt-{attempt}", store)


def _flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Register a flattened sub-mesh; DeviceMesh._flatten is private, so it is wrapped here only."""
    return mesh[dims]._flatten(name)


def build_mesh(cfg: Config, timeout_s: float = 600.0) -> Mesh:
    """Join the process group (gloo on CPU, NCCL on GPU) and build the named mesh."""
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.train.device)
    degrees = resolve_degrees(cfg.parallel, world)
    if world == 1:
        return Mesh(0, 1, 0, device, degrees)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, timeout=timeout, store=_store(rank, world, timeout), rank=rank, world_size=world
        )
    device_mesh = init_device_mesh(device.type, tuple(degrees[d] for d in DIMS), mesh_dim_names=DIMS)
    flattened = {name: _flatten(device_mesh, dims, name) for name, dims in FLATTENED.items()}
    return Mesh(rank, world, local_rank, device, degrees, device_mesh, flattened)


def rank_layout(degrees: dict[str, int]) -> list[dict[str, int]]:
    """Each global rank's coordinate on every dimension (row-major, tp fastest)."""
    out = []
    sizes = [degrees[d] for d in DIMS]
    for r in range(int(torch.tensor(sizes).prod())):
        coord, rest = {}, r
        for d, s in reversed(list(zip(DIMS, sizes, strict=True))):
            coord[d] = rest % s
            rest //= s
        out.append({"rank": r, **{d: coord[d] for d in DIMS}})
    return out


def shutdown(clean: bool = True) -> None:
    """Tear the process groups down; after a clean run all ranks first meet at a barrier on
    every group (in creation order, the same on all ranks), so none closes its connections
    while a peer still has transfers in flight to it (gloo then aborts the peer). After an
    error there is no barrier: the other ranks may be gone."""
    if dist.is_initialized():
        if clean and dist.get_world_size() > 1:
            # a gloo barrier first completes the group's earlier work: flush every group
            # (pipeline sends live on the pp group), then the world
            from torch.distributed import distributed_c10d as c10d

            for group in list(getattr(c10d._world, "pg_map", {})):
                if (
                    group is not dist.group.WORLD
                    and group is not c10d._get_default_group()
                    and dist.get_world_size(group) > 1
                ):
                    dist.barrier(group=group)
            dist.barrier()
        dist.destroy_process_group()
