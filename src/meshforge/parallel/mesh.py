"""The device mesh: every layout is a named N-D mesh of ranks, built from a Layout.

Which dimensions and flattened sub-meshes exist, and in which order, is a layout rule and
lives in ``parallel/rules.py``; this file only turns them into process groups. One
process per device. Under torchrun (or ``meshforge train --nproc N``) the ranks find each
other through the launcher's environment (``launch_env``); started directly, meshforge
is a world of one and needs no process group, except on FSDP2 (bf16 cast once, CPU
offload), which gets a one-rank mesh over an in-memory group (``Mesh.solo_mesh``).
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.compat import mesh_slice_names
from meshforge.config.layout import ISLAND, Layout
from meshforge.errors import ConfigError
from meshforge.launch import env as launch_env


@dataclass
class Mesh:
    """This rank's process groups. The ``Layout`` it was built from (``_layout``) is its own: it
    answers with groups, coordinates and degrees; every layout setting is read from the run
    plan (``plan.layout``), never through the mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    _layout: Layout = field(default_factory=Layout)
    device_mesh: DeviceMesh | None = None
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)
    expert_mesh: DeviceMesh | None = (
        None  # ep > 1: the same ranks as (pp, dp_replicate, edp, ep, tp); see config/layout.py
    )
    ep_group: dist.ProcessGroup | None = None  # ep > 1: the token all-to-all's own group (counted as axis "ep")
    solo: DeviceMesh | None = None  # a world of one on FSDP2 (bf16 cast once, CPU offload): its one-rank mesh

    @property
    def degrees(self) -> dict[str, int]:
        """The whole mesh's degrees (with the island dimension first under DiLoCo)."""
        return self._layout.mesh_degrees()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    @property
    def data_rank(self) -> int:
        """This rank's slice of a global batch among ``Layout.data_ranks`` (islands take their own slices)."""
        island = self.coordinate(ISLAND) if self._layout.islands > 1 else 0
        return island * self._layout.dp + self.dp_rank

    @property
    def loss_name(self) -> str:
        """The sub-mesh of the ranks that hold the same parameters and see other tokens: ``dp_cp``,
        or under cp = 1 ``dp`` (the same ranks, whose name keeps the traffic counted as dp's)."""
        return "dp_cp" if self._layout.cp > 1 else "dp"

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The group the loss and the gradients average over (``loss_name``); None in a world of one."""
        return self.group(self.loss_name)

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
            return self.device_mesh[mesh_slice_names(dims, self._layout.flattened(), self.degrees)]

    def solo_mesh(self) -> DeviceMesh:
        """A world of one's one-rank FSDP2 mesh (for its bf16 cast once per step and CPU offload),
        over an in-memory process group of one; shutdown() tears it down like any other."""
        if self.solo is None:
            if not dist.is_initialized():
                backend = "cuda:nccl,cpu:gloo" if self.device.type == "cuda" else "gloo"
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self.solo = init_device_mesh(self.device.type, (1,), mesh_dim_names=("dp_shard",))
        return self.solo

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.submesh(name).get_group() if self.device_mesh is not None else None

    def coordinate(self, name: str) -> int:
        return self.submesh(name).get_local_rank() if self.device_mesh is not None else 0

    def groups_by_axis(self) -> dict[dist.ProcessGroup, str]:
        """Process group -> axis name, for attributing communication (size-1 axes left out)."""
        out: dict[dist.ProcessGroup, str] = {}
        if self.device_mesh is None:
            return out
        for name in (*self._layout.mesh_degrees(), *self._layout.flattened()):
            sub = self.submesh(name)
            if sub.size() > 1:
                out.setdefault(sub.get_group(), name)
        if self.ep_group is not None:
            out[self.ep_group] = "ep"
        if self.expert_mesh is not None and self.expert_mesh["edp"].size() > 1:
            out.setdefault(self.expert_mesh["edp"].get_group(), "edp")
        return out


def pick_device(requested: str) -> torch.device:
    local_rank = launch_env.local_rank()
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
    to them and time out ("connectFullMesh failed ... Connection refused"). The scope is the
    same on every host, also on one that joined later (``launch_env.attempt_scope``).
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    return dist.PrefixStore(f"meshforge/{launch_env.run_id()}/{launch_env.attempt_scope()}", store)


def _flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Register a flattened sub-mesh; DeviceMesh._flatten is private, so it is wrapped here only."""
    return mesh[dims]._flatten(name)


def build_mesh(dims: Layout, device_kind: str = "auto", timeout_s: float = 600.0, cpu_backend: bool = False) -> Mesh:
    """Join the process group (gloo on CPU, NCCL on GPU) and build the named mesh of ``dims``.
    ``cpu_backend``: on GPU, also gloo for host tensors (CPU offload reduces its host-side figures)."""
    world, rank = launch_env.world_size(), launch_env.rank()
    if dims.world_size != world:
        raise ConfigError(f"the layout {dims.mesh_degrees()} needs {dims.world_size} ranks, but {world} were started")
    device = pick_device(device_kind)
    if world == 1:
        return Mesh(0, 1, 0, device, dims)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if cpu_backend and device.type == "cuda":
            backend = "cuda:nccl,cpu:gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, timeout=timeout, store=_store(rank, world, timeout), rank=rank, world_size=world
        )
    degrees = dims.mesh_degrees()
    device_mesh = init_device_mesh(device.type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))
    flattened = {name: _flatten(device_mesh, sub, name) for name, sub in dims.flattened().items()}
    expert_mesh = ep_group = None
    if dims.ep > 1:
        ed = dims.expert_degrees()
        expert_mesh = init_device_mesh(device.type, tuple(ed.values()), mesh_dim_names=tuple(ed))
        ep_group = _own_groups(expert_mesh, "ep")
    return Mesh(rank, world, launch_env.local_rank(), device, dims, device_mesh, flattened, expert_mesh, ep_group)


def _own_groups(mesh: DeviceMesh, dim: str) -> dist.ProcessGroup:
    """Fresh process groups along ``dim`` (every rank creates all of them, in the same order),
    returning this rank's: a DeviceMesh dimension that spans the world reuses the world group,
    whose traffic the communication counter could then not tell apart from other axes'."""
    axis = mesh.mesh_dim_names.index(dim)
    ranks = mesh.mesh.movedim(axis, -1).reshape(-1, mesh.mesh.shape[axis]).tolist()
    mine = None
    for group_ranks in ranks:
        group = dist.new_group(group_ranks)
        if dist.get_rank() in group_ranks:
            mine = group
    return mine


def shutdown(clean: bool = True) -> None:
    """Tear the process groups down; after a clean run all ranks first meet at a barrier on
    every group (in creation order, the same on all ranks), so none closes its connections
    while a peer still has transfers in flight to it (gloo then aborts the peer). After an
    error there is no barrier: the other ranks may be gone."""
    if dist.is_initialized():
        if clean and dist.get_world_size() > 1:
            # a gloo barrier first completes the group's earlier work: flush every group
            # (pipeline sends live on the pp group), then the world
            for group in list(getattr(c10d._world, "pg_map", {})):
                if (
                    group is not dist.group.WORLD
                    and group is not c10d._get_default_group()
                    and dist.get_world_size(group) > 1
                ):
                    dist.barrier(group=group)
            dist.barrier()
        dist.destroy_process_group()
