"""Accelerator and cluster descriptions the planner reasons with.

Peaks are the vendors' dense tensor-core figures (the same table MFU uses). Bandwidths are
*achievable* ring bus bandwidths per GPU (what NCCL's busbw reports), not link maxima:
NVLink-class inside a node, the network across nodes. Efficiency is the fraction of peak a
large GEMM reaches; ``gemm_half_flop`` is the GEMM size (2mnk) at which half of that is
reached. ``meshforge calibrate`` measures all of these for the local machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from meshforge.errors import ConfigError, suggest
from meshforge.metrics.mfu import PEAK_TFLOPS
from meshforge.models.shape import LOSS_CHUNK_SIZE
from meshforge.safeio.parse import read_json

GIB = 2**30


@dataclass
class Hardware:
    name: str
    peak_flops: dict[str, float]  # precision -> FLOP/s
    hbm_gib: float
    hbm_bw: float  # bytes/s
    intra_bw: float  # bytes/s per GPU, inside a node
    inter_bw: float  # bytes/s per GPU, across nodes
    intra_latency: float = 8e-6  # s per ring step
    inter_latency: float = 20e-6
    gemm_efficiency: float = 0.72  # fraction of peak a large GEMM reaches (cuBLAS bf16 on H100: ~700 of 989)
    gemm_half_flop: float = 2e9  # GEMM size (2mnk) reaching half of that
    # > 0: the model's GEMMs are priced by their smallest dimension d instead, at d/(d + gemm_half_dim)
    # of the best share (planner/kernel_costs.py dense_gemm_rate)
    gemm_half_dim: float = 0.0
    # fraction of peak a fused attention core reaches at long sequences, fwd + bwd (kernel_costs.py
    # lowers it for short ones)
    attention_efficiency: float = 0.50
    # sequence length at which a fused attention kernel reaches half that (0: no dependence, as
    # for a calibrated profile, which measures the attention core at one length; GPU presets: 1024)
    attention_half_seq: float = 0.0
    # the fused causal kernel's measured rates where published (planner/kernel_costs.py): head dim
    # (str) -> [forward, backward] share of peak at long sequences on the FLOPs it does (causal:
    # half the square; backward 2.5x the forward's); empty: attention_efficiency's one share
    attention_kernel: dict = field(default_factory=dict)
    # bytes/(hidden x element size) that norms, residual adds, RoPE and activations read and write
    # per token and layer in one pass, as measured by `meshforge calibrate`; 0: from the block
    # type's arithmetic (planner/kernel_costs.py)
    elementwise_bytes_per_hidden: float = 0.0
    reserve_gib: float = 2.0  # CUDA context, allocator fragmentation, workspaces
    # seconds a block costs whatever its size, per forward + backward pass and per optimizer step
    # (per-op dispatch, measured by `meshforge calibrate` on a CPU; ~0 behind a GPU's async launches)
    block_fixed_s: float = 0.0
    optimizer_fixed_s: float = 0.0
    tp_block_fixed_s: float = 0.0  # the block's fixed cost sharded over tp (DTensor dispatch), less its collectives' α
    # per layout kind ("tp", "fsdp"): seconds a tiny model trained that way costs whatever its size
    # (calibration/layout_fixed.py): "block" and "ends" (embedding, head, loss) per micro-batch,
    # "block_step" and "ends_step" per step (gradient reduction, clipping, optimizer); they include
    # that kind's collectives' latency. Replace block_fixed_s/optimizer_fixed_s for that kind.
    layout_fixed_s: dict = field(default_factory=dict)
    # a CPU profile's compute figures for another count of ranks on this machine (each rank gets
    # cores / ranks threads): str(ranks) -> {field: value}, see for_ranks
    by_ranks: dict = field(default_factory=dict)
    # measured inside one node by `meshforge calibrate`, per collective as training issues it:
    # kind -> [α seconds per ring step, bandwidth bytes/s]; kinds not listed use intra_*
    collectives: dict = field(default_factory=dict)
    # share of data-parallel traffic that hides under concurrent compute (1: its own engine)
    comm_overlap: float = 1.0
    # share of the hidden traffic's time the compute beside it loses (NCCL kernels occupy SMs and
    # memory bandwidth); 0 where communication has its own engine and memory path
    comm_interference: float = 0.7
    # CPU offload (planner/offload_costs.py; 0: no separate host, as on a CPU, or not known): the
    # host link's bytes/s per GPU and direction (PCIe, C2C); the host memory bandwidth one GPU's
    # rank gets for its CPU optimizer step (bytes/s); host memory per node in GiB (0: not checked)
    host_link_bw: float = 0.0
    host_mem_bw: float = 0.0
    host_mem_gib: float = 0.0
    # the run is not compiled (train.compile = false): element-wise chains run op by op
    # (planner/kernel_costs.py: eager_extra_bytes, loss_seconds); False: fused, as compiled
    eager: bool = False
    # the run's train.loss_chunk_size (0: the full logits), for the memory model like ``eager``
    loss_chunk_size: int = LOSS_CHUNK_SIZE
    # the run's train.mixed_precision for bf16 (the memory model's activations, weight copies and
    # gathered weights): "auto" is cast_once on a GPU and autocast on a CPU, as training resolves it
    mixed_precision: str = "auto"
    # ZeRO-2/3 gradients reduce-scattered after every micro-batch's backward (a framework that does not
    # skip the reduction under accumulation, e.g. Composer's FSDP); False: once per step, as meshforge
    reduce_every_microbatch: bool = False
    # the run packs documents of this mean length with document masks (planner/document_costs.py); 0: none
    mean_doc_len: float = 0.0
    source: str = "preset"
    extra: dict = field(default_factory=dict)

    def is_cpu(self) -> bool:
        """A CPU profile (the preset, this CPU's measured one, or a calibrated ``cpu/N``)."""
        return self.name in ("cpu", THIS_CPU) or self.name.startswith("cpu/")

    def mixed(self) -> str:
        """train.mixed_precision as a run on this hardware resolves it (parallel/precision.py)."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        return "autocast" if self.is_cpu() else "cast_once"

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ConfigError(f"{self.name} has no {precision} peak; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[precision]

    def for_ranks(self, ranks: int) -> Hardware:
        """The profile as each of ``ranks`` ranks on one machine sees it: a CPU profile
        measured as N ranks prices a 1-rank run at the rate of all the cores' threads."""
        figures = self.by_ranks.get(str(ranks)) if self.by_ranks else None
        return replace(self, **figures) if figures else self

    def link(self, kind: str, intra: bool) -> tuple[float, float]:
        """Bandwidth and per-step latency of a ``kind`` collective inside a node or across."""
        if not intra:
            return self.inter_bw, self.inter_latency
        for k in (kind, base_kind(kind)):
            if k in self.collectives:
                alpha, bw = self.collectives[k]
                return bw, alpha
        return self.intra_bw, self.intra_latency


def base_kind(kind: str) -> str:
    """ "dtensor_all_gather" -> "all_gather": the collective under the framework's path."""
    return kind.split("_", 1)[1] if kind.startswith(("dtensor_", "fsdp_")) else kind


def cost_coefficients(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, payload multiplier) of the α-β model t = steps·α + mult·S/B for a
    ``kind`` collective over n ranks, S its full (unsharded) payload: a ring all-gather or
    reduce-scatter moves (n-1)/n of S per rank in n-1 steps, an all-reduce both, a
    point-to-point send all of S in one step."""
    kind = base_kind(kind)
    if kind == "send_recv":
        return 1.0, 1.0
    twice = 2.0 if kind == "all_reduce" else 1.0
    return twice * (n - 1), twice * (n - 1) / n


def _tf(kind: str) -> dict[str, float]:
    return {k: v * 1e12 for k, v in PEAK_TFLOPS[kind].items()}


AMPERE_GEMM = 0.78  # fitted: the A100 runs' best GEMM share (docs/planner.md, "What is fitted"; N21, K22, MPT agree)
# Hopper's GEMMs by their smallest dimension (kernel_costs.dense_gemm_rate): the best share 0.66
# (653 TFLOP/s) and half of it at d = 400 give 2048^3 ~550, 4096^3 ~595, 8192^3 ~620 TFLOP/s, at the
# low end of the 600-750 that cuBLAS bf16 reaches on H100 SXM for large GEMMs (sustained training
# clocks); it is the one figure the issue-28 H100 rows calibrate (tests/unit/test_planner_h100_table.py)
HOPPER_GEMM_BEST, HOPPER_HALF_DIM = 0.66, 400.0


def machine_balance(hw: Hardware) -> float:
    """FLOPs per byte of HBM traffic at which the tensor cores and the memory take as long (bf16
    peak / HBM bandwidth): where a roofline turns from memory-bound to compute-bound."""
    return hw.peak("bf16") / hw.hbm_bw


def balance_half_dim(hw: Hardware, hopper: Hardware) -> float:
    """The smallest GEMM dimension at which ``hw`` reaches half its best GEMM rate, from Hopper's
    (fitted on meshforge's own H100 runs) by the roofline: a GEMM whose smallest dimension is d
    does about d FLOPs per byte of the operand that dimension leaves whole (bf16: 2·d·n·k FLOPs over
    2·n·k bytes), so time = FLOPs/peak + bytes/bandwidth gives the rate best·d/(d + c·balance), the
    same c on every generation. An A100 (balance 153) halves at ~210, an H100 SXM (295) at 400."""
    return HOPPER_HALF_DIM * machine_balance(hw) / machine_balance(hopper)


PRESETS: dict[str, Hardware] = {
    # achievable GEMM shares of peak in published training runs (bench/bench_planner_published.py):
    # Ampere reaches a larger share of its (lower) peak than Hopper does of its own
    "a100-40g": Hardware("a100-40g", _tf("a100"), 40, 1.555e12, 230e9, 23e9, gemm_efficiency=AMPERE_GEMM),
    "a100-80g": Hardware("a100-80g", _tf("a100"), 80, 2.039e12, 230e9, 23e9, gemm_efficiency=AMPERE_GEMM),
    "h100-sxm": Hardware(
        "h100-sxm", _tf("h100-sxm"), 80, 3.35e12, 360e9, 45e9
    ),  # GEMMs: HOPPER_GEMM_BEST by their smallest dimension, below
    "h100-pcie": Hardware(
        "h100-pcie", _tf("h100-pcie"), 80, 2.0e12, 50e9, 23e9
    ),  # GEMMs: HOPPER_GEMM_BEST by their smallest dimension, below
    "h200": Hardware(
        "h200", _tf("h200"), 141, 4.8e12, 360e9, 45e9
    ),  # GEMMs: HOPPER_GEMM_BEST by their smallest dimension, below
    "b200": Hardware("b200", _tf("b200"), 180, 8.0e12, 720e9, 45e9),
    "mi300x": Hardware("mi300x", _tf("mi300x"), 192, 5.3e12, 300e9, 45e9, gemm_efficiency=0.6),
    # a generic server CPU; `meshforge calibrate` replaces every number with measured ones
    "cpu": Hardware(
        "cpu",
        {"fp32": 1e11, "bf16": 2e9},
        64,
        20e9,
        2e9,
        1e9,
        intra_latency=50e-6,
        inter_latency=100e-6,
        gemm_efficiency=0.9,
        gemm_half_flop=2e7,
        attention_efficiency=0.3,
        # the process itself beside its tensors at a step's peak: Python, torch, the corpus, malloc's
        # slack; a CPU run at 8K tokens needed 544 MiB of RLIMIT_DATA beyond its tensors' peak
        # (tests/integration/test_peak_memory.py, issue 51), 512 left it 32 MiB short
        reserve_gib=0.5625,
        comm_interference=0.0,
    ),
}


GPU_ATTENTION_HALF_SEQ = 1024.0  # FlashAttention-2 reaches half its rate around 1K-token sequences
for _name in [k for k in PRESETS if k != "cpu"]:
    PRESETS[_name] = replace(PRESETS[_name], attention_half_seq=GPU_ATTENTION_HALF_SEQ)

# Published fused-attention rates on H100 SXM5, bf16, at 4K tokens (Shah et al. 2024, FlashAttention-3,
# arXiv 2407.08608, Figs. 5-6: forward / backward TFLOP/s, FLOPs as the kernels do them, backward
# 2.5x forward), as shares of the 989 TFLOP/s peak. torch >= 2.9 with cuDNN >= 9.15 runs SDPA on
# sm90 with cuDNN first (aten sdp_utils.cpp, check_prefer_cudnn_attention): meshforge's kernel on
# Hopper. The FlashAttention-2 rows are what runs before that (flash-attn 2, e.g. llm-foundry 2023).
ATTENTION_KERNELS = {
    "cudnn-h100": {"64": [408 / 989, 417 / 989], "128": [609 / 989, 499 / 989]},
    "fa2-h100": {"64": [321 / 989, 279 / 989], "128": [368 / 989, 310 / 989]},
}
# FlashAttention in Triton (the 2022 kernel llm-foundry's attn_impl = "triton" ran): Dao 2023
# (FlashAttention-2, arXiv 2307.08691, section 4.1) measures FlashAttention-2 "around 1.3-1.5x
# faster ... in the forward pass and around 2x faster in the backward pass".
ATTENTION_KERNELS["triton-h100"] = {d: [f / 1.4, b / 2.0] for d, (f, b) in ATTENTION_KERNELS["fa2-h100"].items()}
# FlashAttention-2 on A100 80GB SXM4 (Dao 2023, arXiv 2307.08691: "50-73% of the theoretical maximum
# FLOPs/s on A100"; taken as 73% forward, 63% backward at head dim 128 and long sequences, on the FLOPs
# the kernel does): what torch's SDPA runs on Ampere since torch 2.2. The Triton kernel of 2022 by the
# same paper's comparison (the 1.4x / 2x above, measured on the A100).
ATTENTION_KERNELS["fa2-a100"] = {"128": [0.73, 0.63]}
ATTENTION_KERNELS["triton-a100"] = {d: [f / 1.4, b / 2.0] for d, (f, b) in ATTENTION_KERNELS["fa2-a100"].items()}
# A causal kernel on tiles of 128 keys does 1 + 128/s of its useful work (the diagonal tiles), and
# the non-causal kernels themselves reach ~3/4 of their 4K rate at 512 tokens (same figures): both
# together are a half-rate length of ~256 tokens.
KERNEL_HALF_SEQ = 256.0
for _name in ("a100-40g", "a100-80g"):  # Ampere: FlashAttention-2's rates, GEMMs by their smallest dimension
    PRESETS[_name] = replace(
        PRESETS[_name],
        attention_kernel=ATTENTION_KERNELS["fa2-a100"],
        attention_half_seq=KERNEL_HALF_SEQ,
        gemm_half_dim=balance_half_dim(PRESETS[_name], PRESETS["h100-sxm"]),
    )
for _name in ("h100-sxm", "h100-pcie", "h200"):
    PRESETS[_name] = replace(
        PRESETS[_name],
        attention_kernel=ATTENTION_KERNELS["cudnn-h100"],
        attention_half_seq=KERNEL_HALF_SEQ,
        gemm_efficiency=HOPPER_GEMM_BEST,
        gemm_half_dim=HOPPER_HALF_DIM,
    )

# The host side of CPU offload, per preset: (host link bytes/s per GPU and direction, host memory
# bytes/s per GPU, host GiB per node). Host link: PCIe 5.0 x16 is 32 GT/s x 16 lanes x 128/130 =
# 63 GB/s per direction, of which pinned cudaMemcpy reaches ~80-85% (~50-55 GB/s); we take 50 GB/s
# since all GPUs of a node copy at once. PCIe 4.0 x16 (A100): 31.5 GB/s raw, ~25 GB/s effective.
# Host memory bandwidth: the node's DRAM peak (channels x MT/s x 8 bytes) x 0.75 (what STREAM-class
# streaming reaches) / 8 GPUs, on each vendor's 8-GPU system (datasheets): DGX A100 2 x EPYC 7742,
# 8 x DDR4-3200 each (409.6 GB/s); DGX H100/H200 2 x Xeon 8480C, 8 x DDR5-4800 each (614.4 GB/s);
# DGX B200 2 x Xeon 8570, 8 x DDR5-5600 each (716.8 GB/s); an MI300X platform 2 x EPYC 9654,
# 12 x DDR5-4800 each (921.6 GB/s). Host memory: DGX A100 320 GB 1 TB, DGX A100 640 GB / DGX H100 /
# DGX H200 / DGX B200 2 TB; 0 (not checked) where no reference system fixes it. No GH200 preset
# (its 450 GB/s per direction NVLink-C2C would go in host_link_bw).
HOST_SIDE = {
    "a100-40g": (25e9, 409.6e9 * 0.75 / 8, 1024.0),
    "a100-80g": (25e9, 409.6e9 * 0.75 / 8, 2048.0),
    "h100-sxm": (50e9, 614.4e9 * 0.75 / 8, 2048.0),
    "h100-pcie": (50e9, 614.4e9 * 0.75 / 8, 0.0),
    "h200": (50e9, 614.4e9 * 0.75 / 8, 2048.0),
    "b200": (50e9, 716.8e9 * 0.75 / 8, 2048.0),
    "mi300x": (50e9, 921.6e9 * 0.75 / 8, 0.0),
}
for _name, (_link, _mem_bw, _mem_gib) in HOST_SIDE.items():
    PRESETS[_name] = replace(PRESETS[_name], host_link_bw=_link, host_mem_bw=_mem_bw, host_mem_gib=_mem_gib)


THIS_CPU = "this-cpu"  # the planner's hardware for a run on this machine's CPU: measured, not assumed


def profile_fields(c: dict) -> dict:
    """A compute profile (metrics/compute_profile.py's dict) as the Hardware fields it sets."""
    return {
        "peak_flops": c["peaks"],
        "hbm_bw": c["bw"],
        "gemm_half_flop": c["half"],
        "attention_efficiency": c["attn"],
        "elementwise_bytes_per_hidden": c["elem"],
        "block_fixed_s": c.get("fixed", 0.0),
        "optimizer_fixed_s": c.get("opt", 0.0),
    }


def this_cpu(ranks: int = 1) -> Hardware:
    """The ``cpu`` preset with this CPU's own figures (metrics/cpu_peak.cpu_profile: measured on
    first use, about ten seconds, then cached): what a CPU run is priced with when no profile from
    ``meshforge calibrate`` is given. ``ranks`` local ranks get cores/ranks threads each, as
    ``meshforge train --nproc`` gives them; a 1-rank run is priced with every core's (``for_ranks``).
    Collectives and per-layout-kind costs stay the preset's: only calibrate measures them."""
    import os

    from meshforge.metrics.cpu_peak import cpu_profile

    cores = os.cpu_count() or 1
    ranks = max(1, min(ranks, cores))
    prof = cpu_profile(cores // ranks)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        ram = PRESETS["cpu"].hbm_gib
    hw = replace(
        PRESETS["cpu"],
        name=THIS_CPU,
        hbm_gib=ram / ranks,
        gemm_efficiency=1.0,  # the peak is the best measured matmul
        **profile_fields(prof),
        source="this CPU, measured (metrics/cpu_peak.py)",
        extra={"threads_per_rank": cores // ranks, "timing": prof.get("timing", {})},
    )
    if ranks > 1:
        hw.by_ranks = {"1": profile_fields(cpu_profile(cores))}
    return hw


def get_hardware(name: str | None, path: str | None = None, ranks: int = 1) -> Hardware:
    """A preset by name, ``this-cpu`` (this machine's CPU, measured: ``this_cpu``), or a profile
    from ``meshforge calibrate`` at ``path``."""
    if name == THIS_CPU and not path:
        return this_cpu(ranks)
    if path:
        fix = "pass a hardware profile written by meshforge calibrate"
        data = read_json(path, ConfigError, fix)
        try:
            if not isinstance(data, dict):
                raise TypeError(f"it holds a JSON {type(data).__name__}")
            return Hardware(**{**data, "source": str(path)})
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"--hardware {path}: not a hardware profile written by meshforge calibrate ({e})"
            ) from None
    if name not in PRESETS:
        prefixed = [k for k in PRESETS if name and k.startswith(name)]  # 'h100' names a family
        if len(prefixed) > 1:
            hint = f"did you mean {' or '.join(repr(c) for c in prefixed)}?"
        else:
            hint = suggest(prefixed[0] if prefixed else name or "", PRESETS, cutoff=0.6)
        raise ConfigError(f"unknown --gpu {name!r}; {hint} (or {THIS_CPU}, or --hardware FILE)")
    return replace(PRESETS[name])


def to_json(hw: Hardware) -> str:
    return json.dumps(asdict(hw), indent=1)


CUDA_FAMILIES = ("h200", "h100", "a100", "b200", "mi300x")


def preset_for_device(device_name: str) -> str:
    """The hardware preset for a device ("cpu", "cuda:0", or a name such as "NVIDIA H100 80GB
    HBM3"); a CUDA device of no known family plans as an H100 SXM."""
    name = device_name.lower()
    if not name or name.startswith("cpu"):
        return "cpu"
    for family in CUDA_FAMILIES:
        if family in name:
            return next(k for k in PRESETS if k.startswith(family))
    return "h100-sxm"
