"""Process group and device mesh discovery from the torchrun environment.

One process per device. Under torchrun (or ``meshforge train --nproc N``) the ranks
find each other through the RANK / WORLD_SIZE / MASTER_ADDR environment; started
directly, meshforge is a world of one and needs no process group at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.config import Config, data_parallel_degree


@dataclass
class Mesh:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_rank: int
    dp_size: int
    device_mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from meshforge.errors import ConfigError

            raise ConfigError("train.device = 'cuda' but no CUDA device is visible; use train.device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_mesh(cfg: Config, timeout_s: float = 600.0) -> Mesh:
    """Join the process group (gloo on CPU, NCCL on GPU) and build the data-parallel mesh."""
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.train.device)
    dp = data_parallel_degree(cfg, world)
    if world == 1:
        return Mesh(0, 1, 0, device, 0, 1)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    device_mesh = init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
    return Mesh(rank, world, local_rank, device, device_mesh.get_local_rank("dp"), dp, device_mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
