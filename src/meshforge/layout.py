"""The one layout type: ``Layout``, the degrees and every layout setting, spelled as the
config keys ([parallel], plus ``micro_batch_size`` and ``activation_checkpoint`` of [train]
and ``islands`` of [diloco]).

A config resolves once into a ``Layout`` (``meshforge/resolve.py``); the mesh, ``parallelize``,
the planner, the explorer and ``--emit-config`` read it. The [parallel] config section is
derived from these fields (config.py), so a new layout setting is one field here, one row
in docs/configuration.md and the code that applies it. Whether a layout runs is decided by
``parallel/dims/``; this file holds no rules, only the data and its derived quantities.

A *partial* layout (``open_layout``) holds None for what is not decided yet (the planner's
search, the explorer's cross-checks); the rules judge what is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ISLAND = "island"  # DiLoCo: the outermost mesh dimension, in front of DIMS when islands > 1
DEGREES = (*DIMS, "ep")
EXPERT_DIMS = ("pp", "dp_replicate", "edp", "ep", "tp")  # the expert mesh under ep > 1 (see parallel/dims/)
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
TRAIN_KEYS = ("micro_batch_size", "activation_checkpoint")  # layout settings that live in [train]
DILOCO_KEYS = ("islands",)  # layout settings that live in [diloco]
# what the planner searches: open (None) in a partial layout unless fixed
SEARCHED = ("pp", "dp_shard", "cp", "tp", "ep", "zero_stage", "micro_batch_size", "activation_checkpoint")
SEARCHED += ("pp_schedule", "pp_virtual_stages", "offload")


@dataclass(frozen=True)
class Layout:
    """Degrees and layout settings, named as their config keys (docs/configuration.md says
    what each means). In a config any one of dp_replicate, dp_shard, tp, pp, cp may be -1
    (inferred from the world size); a resolved layout has every degree >= 1."""

    dp_replicate: int = 1
    dp_shard: int = 1  # the config's default is -1: whatever the others leave
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # 0: DDP; 1: optimizer state sharded; 2: + gradients; 3: + parameters (FSDP2).
    zero_stage: int = 0
    # Reduce gradients on every micro-batch instead of only the last one (saves the
    # unsharded gradient memory under ZeRO-2/3 at the cost of more communication).
    sync_every_microbatch: bool = False
    ddp_bucket_mb: int = 25
    # Under tp > 1: run norms and residuals on sequence shards (reduce-scatter/all-gather
    # instead of all-reduce: same bytes, 1/tp of those activations). Off: replicated.
    sequence_parallel: bool = True
    # Under tp > 1 with sequence parallelism: overlap the tp all-gathers / reduce-scatters with the
    # GEMMs beside them (async TP, Megatron-Core --tp-comm-overlap). Planned; training refuses it on
    # a non-CUDA device (parallel/dims/) and does not run it yet.
    async_tp: bool = False
    # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv | dualpipev (parallel/pipeline.py)
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules: >= 2; V schedules: 2)
    # blocks per stage chunk, in pipeline order (pp x pp_virtual_stages entries); empty: balanced by cost
    pp_layers: tuple[int, ...] = ()
    num_microbatches: int = 0  # pipeline micro-batches per step and dp rank; 0: from train.micro_batch_size
    # Context parallelism (cp > 1): zigzag gives rank r sequence chunks r and 2cp-1-r (equal causal work);
    # none: contiguous 1/cp. ring: key/value blocks pass rank to rank; allgather: gathered once.
    cp_balance: Literal["zigzag", "none"] = "zigzag"
    cp_rotate: Literal["ring", "allgather"] = "ring"
    # bf16 ZeRO-1: the dtype gradients are reduce-scattered in (bf16 halves the traffic)
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # cpu: FSDP2 keeps sharded parameters, gradients and the optimizer step in host memory (CUDA, ZeRO-2/3)
    offload: Literal["none", "cpu"] = "none"
    # [train] keys
    micro_batch_size: int = 0
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    # [diloco] key: DiLoCo islands, the outermost mesh dimension; the degrees above are one island's
    islands: int = 1

    def degrees(self) -> dict[str, int]:
        """The mesh degrees by dimension, outermost first (one island's: the [parallel] keys)."""
        return {k: getattr(self, k) for k in DIMS}

    def mesh_degrees(self) -> dict[str, int]:
        """The whole mesh: the island dimension in front of ``degrees()`` when there are islands."""
        return {ISLAND: self.islands, **self.degrees()} if self.islands > 1 else self.degrees()

    @property
    def world_size(self) -> int:
        out = 1
        for v in self.mesh_degrees().values():
            out *= v
        return out

    @property
    def dp(self) -> int:
        """Data-parallel ranks of one island: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_ranks(self) -> int:
        """Ranks that take distinct slices of a global batch (the sampler's): every island's dp ranks."""
        return self.islands * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and average gradients (cp ranks see other tokens)."""
        return self.dp * self.cp

    def expert_degrees(self) -> dict[str, int]:
        """The expert mesh's degrees (ep > 1): dp_shard x cp split into edp x ep."""
        edp = self.dp_shard * self.cp // self.ep
        inner = dict(zip(EXPERT_DIMS, (self.pp, self.dp_replicate, edp, self.ep, self.tp), strict=True))
        return {ISLAND: self.islands, **inner} if self.islands > 1 else inner

    def flattened(self) -> dict[str, tuple[str, ...]]:
        """The flattened sub-meshes this layout builds (see parallel/dims/)."""
        return dict(FLATTENED)

    def uses_fsdp(self) -> bool:
        """Data parallelism on FSDP2: ZeRO-2/3, HSDP, and any dp under tp, pp or ep (DDP takes no DTensors)."""
        return self.dp_cp > 1 and (self.zero_stage >= 2 or self.tp > 1 or self.pp > 1 or self.ep > 1)

    def local_batch(self, global_batch: int) -> int:
        return global_batch // self.data_ranks

    def microbatches(self, global_batch: int) -> int:
        """Pipeline micro-batches per step and dp rank: given, else from the micro-batch size,
        else the largest divisor of the local batch up to 2 x pp x chunks per rank."""
        local = self.local_batch(global_batch)
        if self.num_microbatches:
            return self.num_microbatches
        if self.micro_batch_size:
            return max(1, local // self.micro_batch_size)
        target = 2 * self.pp * self.pp_virtual_stages
        return max(d for d in range(1, max(1, min(local, target)) + 1) if local % d == 0)

    def is_partial(self) -> bool:
        return any(getattr(self, k) is None for k in SEARCHED)

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)


KEYS = tuple(f.name for f in dataclasses.fields(Layout))


def open_layout(**given: Any) -> Layout:
    """A partial layout: what the planner searches is None (open) unless given."""
    unknown = set(given) - set(KEYS)
    if unknown:
        raise TypeError(f"not layout keys: {', '.join(sorted(unknown))}")
    return Layout(**{**{k: None for k in SEARCHED}, **given})


def from_sections(*sections: Any) -> Layout:
    """The layout a config states: each field read from the first section that has the key
    (``from_sections(cfg.parallel, cfg.train, cfg.diloco)``), lists as tuples."""
    values = {}
    for k in KEYS:
        for s in sections:
            if hasattr(s, k):
                v = getattr(s, k)
                values[k] = tuple(v) if isinstance(v, list) else v
                break
    return Layout(**values)


def section_values(layout: Layout) -> dict[str, dict[str, Any]]:
    """The layout as config values by section ({"parallel": ..., "train": ...}), lists as lists."""
    out: dict[str, dict[str, Any]] = {"parallel": {}, "train": {}, "diloco": {}}
    for k in KEYS:
        v = getattr(layout, k)
        section = "train" if k in TRAIN_KEYS else "diloco" if k in DILOCO_KEYS else "parallel"
        out[section][k] = list(v) if isinstance(v, tuple) else v
    return out
