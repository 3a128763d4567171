"""The one layout type: ``Layout``, the degrees and every layout setting, spelled as the
config keys ([parallel], plus ``micro_batch_size`` and ``activation_checkpoint`` of [train]
``islands`` of [diloco] and ``replicas`` of [fault_tolerance]: each field's ``section`` metadata says which).

These fields ARE the config's layout keys (config/keys.py reads them, docstrings included),
so a new layout setting is one field here and the code that applies it. A config resolves
once into a run plan whose ``layout`` every part reads (``meshforge/resolve.py``): the mesh,
``parallelize``, the planner, the explorer and ``--emit-config``. Whether a layout runs is
decided by ``parallel/rules.py``; this file holds no rules, only the data and its derived
quantities.

A *partial* layout (``open_layout``) holds None for what is not decided yet (the planner's
search, the explorer's cross-checks); the rules judge what is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from meshforge.ranges import BLOCKS, DEGREE, TOKENS, ranged, whole

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ISLAND = "island"  # DiLoCo: the outermost mesh dimension, in front of DIMS when islands > 1
EXPERT_DIMS = ("pp", "dp_replicate", "edp", "ep", "tp")  # the expert mesh under ep > 1 (see parallel/rules.py)
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# what the planner searches: open (None) in a partial layout unless fixed
SEARCHED = ("pp", "dp_shard", "cp", "tp", "ep", "zero_stage", "micro_batch_size", "activation_checkpoint")
SEARCHED += ("pp_schedule", "pp_virtual_stages", "offload")


@dataclass(frozen=True)
class BatchSplit:
    """One data-parallel rank's share of a global batch (``Layout.batch_split``)."""

    local: int
    """sequences per optimizer step on one data-parallel rank (DiLoCo islands take their own slices)"""
    micro: int
    """sequences per forward pass"""
    count: int
    """forward passes per step: gradient accumulation, or a pipeline's micro-batches"""


@dataclass(frozen=True)
class Layout:
    """Degrees and layout settings, each one config key, declared here once: a field's docstring
    is its help and its ``section`` metadata the config section that spells it ([parallel]
    unless said). In a config any one of dp_replicate, dp_shard, tp, pp, cp may be -1
    (inferred from the world size); a resolved layout has every degree >= 1."""

    dp_replicate: int = ranged(DEGREE, 1)
    """data-parallel groups that replicate each other (HSDP, with zero_stage 2 or 3); -1 infers it"""
    dp_shard: int = ranged(DEGREE, 1)
    """data-parallel ranks that shard (stages 2/3) or replicate (stages 0/1) within a group; -1 (the config's
    default) infers it from the world size"""
    tp: int = ranged(DEGREE, 1)
    """tensor-parallel degree (Megatron column/row; innermost mesh dimension; must divide heads, kv_heads,
    ffn_hidden, vocab_size and, under SP, seq_len; at most the ranks per node).
    See [parallelism.md](parallelism.md#tensor-parallelism-with-sequence-parallelism)"""
    pp: int = ranged(DEGREE, 1)
    """pipeline-parallel degree (outermost mesh dimension; the layer stack is cut into pp x pp_virtual_stages
    chunks). See [parallelism.md](parallelism.md#pipeline-parallelism)"""
    cp: int = ranged(DEGREE, 1)
    """context-parallel degree: each sequence is split over cp ranks, attention runs over a ring (see
    [parallelism.md](parallelism.md#context-parallelism)); composes with DDP, ZeRO-1/2/3, HSDP, tp (+SP) and
    pp; FSDP and ZeRO-1 shard over dp × cp; seq_len must be a multiple of 2 x cp (zigzag)"""
    ep: int = ranged(whole(1, 2**20), 1)
    """expert-parallel degree: each MoE block's experts split over this many data-parallel ranks (must divide
    `model.num_experts` and dp_shard × cp; see [moe.md](moe.md))"""
    ep_chunks: int = ranged(whole(0, 1024), 0)
    """under ep > 1: each MoE layer's tokens go out in this many chunks, so one chunk's dispatch or combine
    all-to-all runs while another chunk's experts compute (1: one all-to-all each way, nothing overlapped);
    `0` = auto: 2 where the ep group spans nodes, 1 inside a node (fast links: the chunks cost more than
    they hide). See [moe.md](moe.md)"""
    zero_stage: int = ranged(whole(0, 3), 0)
    """0 DDP; 1 optimizer state sharded (fp32: ZeroRedundancyOptimizer; bf16/fp8: bf16 working state, fp32
    master + Adam sharded, 4Ψ + 12Ψ/N, see [precision.md](precision.md)); 2 + gradients (FSDP2, params kept
    gathered fwd→bwd); 3 + parameters (FSDP2). Under tp > 1 every stage runs on FSDP2 (stage 0: replicated
    parameters, gradients all-reduced) and stage 1 is refused. See [parallelism.md](parallelism.md)"""
    sync_every_microbatch: bool = False
    """reduce gradients on every micro-batch instead of only the last (under ZeRO-2/3: less memory, more
    traffic)"""
    ddp_bucket_mb: int = ranged(whole(1, 2**16), 25)
    """gradient bucket size in MiB (stages 0/1): DDP's all-reduce buckets, and bf16 ZeRO-1's reduce-scatter buckets,
    each reduced during backward as soon as its gradients are in"""
    sequence_parallel: bool = True
    """under tp > 1, run norms and residuals on sequence shards (reduce-scatter + all-gather instead of
    all-reduce: same bytes, 1/tp of those activations); false: replicated"""
    async_tp: bool = False
    """under tp > 1 with sequence parallelism: overlap the tp all-gathers / reduce-scatters with the GEMMs
    beside them (async TP, Megatron-Core `--tp-comm-overlap`): a decomposed collective matmul on any backend;
    on CUDA torch's symmetric-memory fused ops (eager) or inductor's micro-pipeline TP (train.compile);
    `meshforge plan --tp-overlap` prices it. See [parallelism.md](parallelism.md#communication-under-compute)"""
    pp_schedule: str = "1f1b"
    """`gpipe`, `1f1b`, `interleaved_1f1b`, `zero_bubble` (interleaved zero bubble), `zbv`, `dualpipev` (the last
    two where the installed PyTorch has them)"""
    pp_virtual_stages: int = ranged(whole(1, BLOCKS), 1)
    """model chunks per pipeline rank: 1 for gpipe/1f1b, >= 2 for interleaved_1f1b, >= 1 for zero_bubble, 2 for
    zbv/dualpipev"""
    pp_layers: tuple[int, ...] = ranged(whole(0, BLOCKS), (), each=True)
    """blocks per chunk in pipeline order (pp x pp_virtual_stages numbers summing to model.layers), e.g.
    `[9, 10, 10, 3]`; the first and the last may be 0 (a chunk of only the embedding or only the head, as
    Llama 3 balanced its stages); empty: balanced by cost (the embedding and head count as work)"""
    num_microbatches: int = ranged(whole(0, TOKENS), 0)
    """pipeline micro-batches per step and dp rank (>= pp; a multiple of the rounds for interleaving); 0:
    per-rank batch / train.micro_batch_size, or the largest divisor of the per-rank batch up to 2 x pp x
    pp_virtual_stages"""
    cp_balance: Literal["zigzag", "none"] = "zigzag"
    """how sequences split over cp ranks: `zigzag` (2 x cp chunks, rank r holds r and 2cp-1-r: equal causal
    work; seq_len a multiple of 2 x cp) or `none` (contiguous 1/cp; seq_len a multiple of cp)"""
    cp_rotate: Literal["ring", "allgather"] = "ring"
    """how key/value blocks reach every cp rank: `ring` (point-to-point to the next rank, one block at a time)
    or `allgather` (all blocks gathered once; cp x the K/V memory)"""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """bf16/fp8 ZeRO-1: the dtype gradients are reduce-scattered in: `fp32` or `bf16` (half the traffic, bf16
    sums). See [precision.md](precision.md)"""
    offload: Literal["none", "cpu"] = "none"
    """`cpu`: FSDP2's CPU offload keeps sharded parameters, gradients and the optimizer step in host memory
    (CUDA only; needs zero_stage 2 or 3 with dp > 1, or a world of one; refused on a CPU run: the state already
    lives there). See [precision.md](precision.md#cpu-offload)"""
    micro_batch_size: int = ranged(whole(0, TOKENS), 0, section="train")
    """sequences per forward pass per rank; 0 = the whole per-rank batch (no accumulation)"""
    activation_checkpoint: Literal["none", "full", "selective"] = field(default="none", metadata={"section": "train"})
    """`none`, `full` (recompute each block) or `selective` (keep matmul outputs)"""
    islands: int = ranged(whole(1, 2**20), 1, section="diloco")
    """DiLoCo islands (outermost mesh dimension; each runs the `[parallel]` layout on world / islands ranks);
    `1` = off"""
    replicas: int = ranged(whole(1, 2**10), 1, section="fault_tolerance")
    """replica groups the run is planned for: each is one `meshforge train` with this `[parallel]` layout and its
    own `run.dir`, takes its own fixed 1/replicas slice of every global batch, and averages gradients with the
    live groups (`fault_tolerance.enabled`); `1` = one group"""

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
        """Ranks that take distinct slices of a global batch (the sampler's): every island's dp ranks, in
        every replica group (fault tolerance)."""
        return self.replicas * self.islands * self.dp

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
        """The flattened sub-meshes this layout builds (see parallel/rules.py)."""
        return dict(FLATTENED)

    def uses_fsdp(self) -> bool:
        """Data parallelism on FSDP2: ZeRO-2/3, HSDP, and any dp under tp, pp or ep (DDP takes no DTensors)."""
        return self.dp_cp > 1 and (self.zero_stage >= 2 or self.tp > 1 or self.pp > 1 or self.ep > 1)

    def batch_split(self, global_batch: int) -> BatchSplit:
        """How one data-parallel rank takes its slice of a global batch: the one place the local
        batch, the micro-batch and their count are derived. Under a pipeline the count is
        parallel.num_microbatches, else from train.micro_batch_size, else the largest divisor of
        the local batch up to 2 x pp x chunks per rank; without one it is the accumulation of
        micro_batch_size (0: the whole local batch) over the local batch."""
        local = global_batch // self.data_ranks
        if self.pp > 1:
            if self.num_microbatches:
                count = self.num_microbatches
            elif self.micro_batch_size:
                count = max(1, local // self.micro_batch_size)
            else:
                target = 2 * self.pp * self.pp_virtual_stages
                count = max(d for d in range(1, max(1, min(local, target)) + 1) if local % d == 0)
            return BatchSplit(local, local // count, count)
        micro = self.micro_batch_size or local
        return BatchSplit(local, micro, local // micro if micro else 0)

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
