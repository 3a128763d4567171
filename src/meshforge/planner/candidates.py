"""The layouts a cluster allows: every degree, ZeRO stage, micro-batch, recompute mode,
schedule and offload choice the fixed flags leave open, put to the layout rules in
``parallel/rules.py`` (``judge``); search.py estimates and ranks them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from meshforge.config.layout import Layout
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape
from meshforge.parallel import rules
from meshforge.parallel.rules import RECOMPUTE, Batch, Spelling, tp_divides_heads
from meshforge.planner.estimate import SCHEDULES, V_SCHEDULES, plan_layout, run_layout
from meshforge.planner.hardware import Hardware
from meshforge.planner.offload_costs import can_offload


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt n) (a million GPUs or experts is searched at once)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# config key -> the `meshforge plan` flag that sets it: the one table between the two vocabularies.
# plan_args.py builds each of these flags from its key's field (help, range or words), so a key
# added here is a flag whose limits are the config's; the explorer names its share in params.py.
KEY_FLAGS = {
    "model.layers": "--layers",
    "model.hidden": "--hidden",
    "model.heads": "--heads",
    "model.kv_heads": "--kv-heads",
    "model.ffn_hidden": "--ffn-hidden",
    "model.vocab_size": "--vocab",
    "model.tie_embeddings": "--tie-embeddings",
    "model.num_experts": "--experts",
    "model.experts_per_token": "--top-k",
    "model.moe_ffn_hidden": "--moe-ffn-hidden",
    "model.num_shared_experts": "--shared-experts",
    "model.capacity_factor": "--capacity-factor",
    "train.seq_len": "--seq-len",
    "train.global_batch_size": "--global-batch",
    "train.precision": "--precision",
    "train.mixed_precision": "--mixed-precision",
    "train.compile": "--compiled",
    "train.micro_batch_size": "--micro-batch",
    "train.activation_checkpoint": "--recompute",
    "parallel.tp": "--tp",
    "parallel.pp": "--pp",
    "parallel.dp_shard": "--dp",
    "parallel.cp": "--cp",
    "parallel.ep": "--ep",
    "parallel.zero_stage": "--zero",
    "parallel.pp_virtual_stages": "--virtual-stages",
    "parallel.pp_schedule": "--schedule",
    "parallel.pp_layers": "--pp-layers",
    "parallel.offload": "--offload",
    "parallel.async_tp": "--tp-overlap",
    "parallel.sequence_parallel": "--no-sequence-parallel",
    "diloco.islands": "--islands",
    "diloco.inner_steps": "--inner-steps",
    "diloco.fragments": "--fragments",
    "diloco.delay": "--delay",
    "diloco.sync_dtype": "--sync-dtype",
}
# how the layout rules' messages name a key (rules.partial_problems): the flags, the model's
# head counts by name (they may come from a preset), and the cluster's flags
PLAN_FLAGS = Spelling(
    {
        **KEY_FLAGS,
        "model.heads": "heads",
        "model.kv_heads": "kv_heads",
        "gpus": "--gpus",
        "gpus_per_node": "--gpus-per-node",
    },
    sep=" ",
)


def check_fixed(shape: ModelShape, gpus: int, f: Layout, gpus_per_node: int) -> None:
    """Refuse impossible fixed choices with the layout rules' reason and fix (``rules.partial_problems``)."""
    for problem in rules.partial_problems(f, shape, gpus, gpus_per_node, PLAN_FLAGS):
        if problem.kind == "invalid":
            raise ConfigError(problem.message)


def offload_modes(f: Layout, hw: Hardware) -> list[str]:
    """The offload settings to search, in order: a fixed one, or (auto) none first and CPU
    offload only if nothing runnable fits without it, where the hardware has a host to offload to."""
    mode = f.offload or "auto"
    if mode == "cpu" and not can_offload(hw):
        raise ConfigError(
            f"--offload cpu: {hw.name} has no host to offload to (on a CPU the state already lives in host "
            "memory; a calibrated profile needs host_link_bw and host_mem_bw); use --offload none or a GPU preset"
        )
    if mode == "auto":
        return ["none", "cpu"] if can_offload(hw) else ["none"]
    return [mode]


def judge(lay: Layout, shape: ModelShape, seq: int, global_batch: int, gpus_per_node: int) -> tuple[bool, str]:
    """(exists, why train refuses it or ""): the layout rules' verdict on the layout as its
    emitted config states it (``run_layout``)."""
    found = rules.problems(run_layout(lay), shape, Batch(seq, global_batch, gpus_per_node))
    if any(p.kind == "invalid" for p in found):
        return False, found[0].message
    return True, found[0].message if found else ""


def candidates(
    shape: ModelShape, gpus: int, global_batch: int, seq: int, f: Layout, gpus_per_node: int
) -> Iterator[Layout]:
    """Every combination of the searched choices (valid or not: the rules judge them)."""
    tps = [f.tp] if f.tp else [t for t in divisors(gpus_per_node) if tp_divides_heads(shape, t)]
    pps = [f.pp] if f.pp else [p for p in divisors(gpus) if p <= min(64, shape.layers)]
    for tp in tps:
        for pp in pps:
            for cp in [f.cp] if f.cp else [1]:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if (f.dp_shard and dp != f.dp_shard) or global_batch % dp:
                    continue
                for ep in _ep_choices(shape, dp * cp, f):
                    yield from _per_rank_choices(tp, pp, dp, cp, ep, global_batch // dp, f, shape)


def _ep_choices(shape: ModelShape, dp_cp: int, f: Layout) -> list[int]:
    """Expert-parallel degrees to try: the fixed one, else (MoE) every divisor of the experts
    that divides the data-parallel ranks it borrows (the rules judge the rest)."""
    if f.ep:
        return [f.ep]
    return [e for e in divisors(max(1, shape.num_experts)) if dp_cp % e == 0]


def _zero_choices(dp_cp: int, ep: int, f: Layout) -> list[int]:
    """ZeRO stages to try; under ep the model runs on FSDP2 (rules.uses_fsdp), searched as stages 2 and 3,
    as is CPU offload on one data-parallel rank (the layout rule refuses it except on a world of one)."""
    if f.zero_stage is not None:
        return [f.zero_stage]
    if dp_cp == 1:  # a world of one offloads on a one-rank FSDP2 mesh (ZeRO-2/3; rules.offload_problem)
        return [2, 3] if f.offload == "cpu" else [0]
    return [2, 3] if ep > 1 else [0, 1, 2, 3]


def _per_rank_choices(
    tp: int, pp: int, dp: int, cp: int, ep: int, local: int, f: Layout, shape: ModelShape
) -> Iterator[Layout]:
    if f.micro_batch_size is not None:  # fixed; 0: the whole per-rank batch, as train.micro_batch_size = 0
        micros = [f.micro_batch_size or max(1, local)]
    else:
        micros = [b for b in (1, 2, 4, 8, 16) if local % b == 0]
    offload = "cpu" if f.offload == "cpu" else "none"  # one setting per pass (offload_modes)
    for mb in micros:
        if local % mb:
            continue
        for zero in _zero_choices(dp * cp, ep, f):
            for rc in [f.activation_checkpoint] if f.activation_checkpoint else RECOMPUTE:
                for sched, v, split in schedules(pp, f, shape.layers):
                    yield plan_layout(
                        tp,
                        pp,
                        dp,
                        cp=cp,
                        ep=ep,
                        zero_stage=zero,
                        micro_batch_size=mb,
                        num_microbatches=local // mb,
                        activation_checkpoint=rc,
                        pp_virtual_stages=v,
                        pp_schedule=sched,
                        sequence_parallel=f.sequence_parallel,
                        async_tp=f.async_tp,
                        ep_chunks=f.ep_chunks,
                        ddp_bucket_mb=f.ddp_bucket_mb,
                        offload=offload,
                        pp_layers=split,
                    )


def layouts(
    shape: ModelShape,
    gpus: int,
    global_batch: int,
    seq: int,
    f: Layout,
    gpus_per_node: int,
    stop: Callable[[], bool] | None = None,
):
    """Every layout the rules let exist, with (runnable, reason); ends early when ``stop()`` says so."""
    for lay in candidates(shape, gpus, global_batch, seq, f, gpus_per_node):
        if stop is not None and stop():
            return
        exists, reason = judge(lay, shape, seq, global_batch, gpus_per_node)
        if exists:
            yield lay, reason


def schedules(pp: int, f: Layout, layers: int = 0) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    """(schedule, chunks per rank, blocks per chunk or ()) to try; the V schedules only when asked
    for. Interleaved 1F1B is searched only as Megatron-LM can run it: pp > 2 (its parallel_state
    refuses the interleaved schedule at pp <= 2), over the chunk counts ``_interleavings`` gives;
    a fixed --virtual-stages (or a --pp-layers split, which implies it) is priced as asked."""
    if pp == 1:
        yield "none", 1, f.pp_layers
        return
    for s in [f.pp_schedule] if f.pp_schedule else SCHEDULES:
        if s == "interleaved_1f1b":
            if f.pp_virtual_stages or f.pp_layers:
                yield s, f.pp_virtual_stages or max(1, len(f.pp_layers) // pp), f.pp_layers
            elif pp > 2:
                yield from ((s, v, split) for v, split in _interleavings(pp, layers))
        elif s in V_SCHEDULES:
            yield s, 2, f.pp_layers
        else:
            yield s, f.pp_virtual_stages if s == "zero_bubble" and f.pp_virtual_stages else 1, f.pp_layers


def _interleavings(pp: int, layers: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """The chunk counts Megatron-LM runs: every v >= 2 dividing the blocks per stage, ceil(L/p)
    (its arguments check num_layers_per_pipeline_stage % layers_per_virtual_stage == 0), evenly
    split; and every v for which the blocks plus the embedding and the loss, each counted as one
    block (Megatron's account_for_embedding/loss_in_pipeline_split; Llama 3's 126 blocks in
    16 x 8 chunks), divide into pp x v equal chunks: then the first and the last chunk hold one
    block fewer (none, at one block per chunk)."""
    per_stage = -(-layers // pp)
    for v in range(2, per_stage + 1):
        if per_stage % v == 0:
            yield v, ()
    for v in range(2, (layers + 2) // pp + 1):
        k, rest = divmod(layers + 2, pp * v)
        if not rest and k >= 1 and (k > 1 or layers >= pp * v - 2):
            yield v, (k - 1,) + (k,) * (pp * v - 2) + (k - 1,)
