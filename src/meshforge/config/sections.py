"""The config sections that are not the model's shape or the layout: one frozen dataclass
per TOML section, one field per key. A field's docstring is its help (``meshforge train
--help``, docs/configuration.md); its type is what the loader accepts. [model]'s shape
fields are ``ModelShape``'s (models/shape.py) and [parallel]'s are ``Layout``'s (config/layout.py),
declared there once. ``auto`` and the other automatic values are replaced when a config
resolves into a run plan (resolve.py), so a run's config.toml holds none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshforge.config.layout import Layout
from meshforge.models.presets import get_preset
from meshforge.models.shape import LOSS_CHUNK_SIZE, ModelShape
from meshforge.ranges import BLOCKS, MAX_STEPS, TOKENS, Span, ranged, unit, whole


@dataclass(frozen=True)
class ModelConfig:
    """[model] besides the shape: where the shape and the first weights come from."""

    preset: str = "debug"
    """named shape: `debug`, `debug-moe`, `llama3.2-1b`, `llama3.2-3b`, `llama3.1-8b`, `llama3.1-70b`,
    `llama3.1-405b`, `mixtral-8x7b`, `qwen3-30b-a3b`; the shape keys below override its fields"""
    init_from: str = ""
    """start from these weights: a meshforge weights dir (e.g. a run's `final/`) or a Hugging Face Llama dir;
    the shape must match"""
    auto_shape: tuple[str, ...] = field(default=("vocab_size",), metadata={"config": False})
    """the shape fields left to the resolution (given as `"auto"`, or by default): resolve.py fills them"""


@dataclass(frozen=True)
class TrainConfig:
    """[train]: the batch, precision and the step (micro_batch_size and activation_checkpoint are layout keys)."""

    steps: int = ranged(whole(1, MAX_STEPS), 200)
    """optimizer steps"""
    seq_len: int = ranged(whole(1, TOKENS), 256)
    """tokens per sequence"""
    global_batch_size: int = ranged(whole(1, TOKENS), 16)
    """sequences per optimizer step, over all ranks"""
    seed: int = ranged(whole(0, 2**32 - 1), 0)
    """seeds the initial weights (per parameter name) and the data order"""
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `fp32`, `bf16`, `fp8` (bf16 plus fp8 matmuls in the chosen linears
    through torchao; emulated on CPU; needs `pip install 'meshforge[fp8]'`). See [precision.md](precision.md)"""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """fp8 scaling: `tensorwise` (one dynamic scale per tensor; fp8 all-gather where FSDP2 shards over more than
    one rank, on fp8 GPUs) or `rowwise` (one per row: more accurate)"""
    fp8_exclude: tuple[str, ...] = ("output", "*router*")
    """module-name patterns (fnmatch, e.g. `"layers.0.*"`) kept in bf16 under fp8; linears with a dimension not a
    multiple of 16 always are. Setting it replaces the default (keep `"output"` to keep the head in bf16). A
    pattern that matches nothing is a warning event; one that leaves no linear in fp8 is refused"""
    mixed_precision: Literal["auto", "cast_once", "autocast", "none"] = "auto"
    """how bf16/fp8 weights reach the matmuls: `auto` (`cast_once` on CUDA, `autocast` on CPU, where FSDP2's
    per-unit host work costs more than the casts; `none` for fp32), `cast_once` (FSDP2's mixed-precision policy
    casts each fp32 weight to bf16 once per micro-batch and reduces gradients in fp32; a world of one and DDP's
    layouts run on FSDP2 for it) or `autocast` (`torch.autocast` casts every weight at every use).
    See [precision.md](precision.md#one-cast-per-step)"""
    loss_chunk_size: int = ranged(whole(0, TOKENS), LOSS_CHUNK_SIZE)
    """tokens per chunk of the fused head + cross-entropy (only one chunk's logits exist, in fp32 for the
    softmax); 0 = the plain loss over the full logits. See [model.md](model.md#chunked-loss)"""
    grad_clip: float = ranged(unit(1e6), 1.0)
    """global gradient-norm clip; 0 turns it off"""
    compile: bool = False
    """`torch.compile` each block"""
    deterministic: bool = False
    """deterministic algorithms; on CPU two runs give bit-identical losses"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` (CUDA when a GPU is visible), `cpu` or `cuda`"""
    skip_memory_check: bool = False
    """start even where the pre-flight fit check refuses the run (the planner's estimate exceeds the GPU's free
    memory, or on a CPU the RAM available to each local rank). See [precision.md](precision.md#pre-flight-fit-check)"""
    eval_interval: int = ranged(whole(0, MAX_STEPS), 0)
    """evaluate on the validation split every N steps; 0 = only at the end"""
    eval_batches: int = ranged(whole(0, 2**20), 4)
    """global batches of validation data per evaluation (the same sequences on every layout); 0 = no evaluation"""


@dataclass(frozen=True)
class OptimConfig:
    """[optim]: AdamW and the learning-rate schedule."""

    name: Literal["adamw"] = "adamw"
    """optimizer (`adamw`); no weight decay on norms and embeddings"""
    lr: float = ranged(unit(10.0, lo_open=True), 3e-3)
    """peak learning rate"""
    min_lr_ratio: float = ranged(unit(), 0.1)
    """the decay ends at `lr × min_lr_ratio`"""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """after warmup: `cosine`, `linear` or `constant`, or `wsd` (warmup-stable-decay: the peak until the last
    `decay_fraction` of the run, then a linear decay; extending the run with `--resume` continues from the stable
    phase, so it equals a run meant to be that long). `cosine` and `linear` extended are stretched to the new end.
    See [checkpointing.md](checkpointing.md#continuing-a-run)"""
    warmup_steps: int = ranged(whole(0, MAX_STEPS, -1), -1)
    """linear warmup steps; -1 = min(100, steps/10); more than `train.steps` is clipped to it (and said)"""
    decay_steps: int = ranged(whole(0, MAX_STEPS), 0)
    """`cosine`, `linear`: the step at which the decay reaches the floor; 0 = the end of the run (not for `wsd`,
    whose decay is `decay_fraction`)"""
    decay_fraction: float = ranged(unit(lo_open=True), 0.2)
    """`wsd`: the share of `train.steps` the final decay takes (it moves with the end when a run is extended)"""
    weight_decay: float = ranged(unit(10.0), 0.1)
    """AdamW decoupled weight decay"""
    beta1: float = ranged(unit(hi_open=True), 0.9)
    """Adam β1"""
    beta2: float = ranged(unit(hi_open=True), 0.95)
    """Adam β2"""
    eps: float = ranged(unit(lo_open=True), 1e-8)
    """Adam ε"""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """`auto` (fused on CUDA and CPU: one kernel per step, no host reads of the step counters; foreach
    elsewhere), `fused`, `foreach`, `for-loop`"""


@dataclass(frozen=True)
class DataConfig:
    """[data]: the corpus and its tokenizer."""

    path: str = ""
    """empty = the default corpus (Python stdlib sources); else text/dir/JSONL, or a prepared shard dir"""
    tokenizer: str = "byte"
    """`byte` or a path to a Hugging Face `tokenizer.json`"""
    val_fraction: float = ranged(unit(hi_open=True), 0.01)
    """share of the corpus held out for validation, as raw text is prepared (a prepared shard dir keeps the split
    `meshforge data prepare --val-fraction` made)"""
    cache_dir: str = ""
    """where prepared corpora are cached; empty = `$MESHFORGE_CACHE` or `~/.cache/meshforge`"""
    allow_binary: bool = False
    """train on files that are mostly not text (more than 30% of their bytes invalid UTF-8 or control characters);
    by default such data is refused with exit 2"""
    document_mask: bool = True
    """attention stays inside each document of a packed sequence (documents end at the tokenizer's end-of-text
    token), as Llama 3 trains; `false`: causal over the whole sequence, across documents. See
    [data.md](data.md#packed-documents)"""
    reset_positions: bool = True
    """RoPE positions restart at 0 at each document of a packed sequence; `false`: they count over the whole
    sequence"""


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: sharded training checkpoints, resuming, the final weights."""

    interval: int | str = ranged(whole(0, MAX_STEPS), 0)
    """steps between sharded training checkpoints in `run.dir/checkpoints` (also one at the end); 0: none;
    `"auto"`: the Young/Daly optimum √(2 × blocking cost × MTBF), re-measured as the run goes (one save early to
    measure its cost, then that interval); the run plan and config.toml name this cadence `"young_daly"`, which a
    config may also give. See [checkpointing.md](checkpointing.md)"""
    memory_interval: int = ranged(whole(0, MAX_STEPS), 0)
    """steps between checkpoints in memory; 0: none. Each rank copies its shard of the training state to host
    memory (training waits for that copy only) and sends it, in the background, to a keeper process on its host
    and to the next host's keeper; a restart (`--max-restarts`, torchrun) loads the newest one every rank can
    fetch when it is no older than the newest disk checkpoint, else the disk one. Needs a launcher that restarts
    ranks (`--nproc N` or torchrun); `interval`'s disk checkpoints stay the persistent tier. See
    [checkpointing.md](checkpointing.md#checkpoints-in-memory)"""
    keep: int = ranged(whole(1, 10**6), 3)
    """complete checkpoints to keep; older ones are deleted"""
    async_: bool = field(default=False, metadata={"key": "async"})
    """write checkpoints in the background (training blocks only for the copy to host memory)"""
    load: str = "latest"
    """`latest`: resume from the newest complete checkpoint in `run.dir/checkpoints` if there is one; `none`:
    never; or a checkpoint directory / `checkpoints/` folder (also from another run and layout)"""
    mtbf_hours: float = ranged(Span(0.0, 1e6, lo_open=True), 24.0)
    """the job's mean time between failures, for `interval = "auto"`"""
    final: bool = True
    """keep a resumable checkpoint (weights, optimizer, data position, RNG) in `run.dir/checkpoints` at the end of
    the run (also after Ctrl-C), whatever `interval`, and under `optim.schedule = "wsd"` one at the end of the
    stable phase: `meshforge train --resume RUN_DIR --train.steps=M` continues from them. `false`: only
    `interval`'s checkpoints (with `interval = 0`, the final weights alone)"""
    save_final: bool = True
    """write the final weights (the model alone, no optimizer: for `model.init_from`, `generate`, `convert`) to
    `run.dir/final` (also after Ctrl-C); the resumable end of a run is `final`'s checkpoint"""
    export_hf: bool = False
    """also write `run.dir/final-hf`, a Hugging Face directory"""


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]: where step records go."""

    log_interval: int = ranged(whole(1, MAX_STEPS), 10)
    """log step 1, then every N steps and the last (metrics.jsonl, console, TensorBoard)"""
    console: bool = True
    """progress lines and the summary on stdout"""
    jsonl: bool = True
    """write `metrics.jsonl`"""
    tensorboard: bool = False
    """write TensorBoard event files under `run.dir/tensorboard` (through `torch.utils.tensorboard`; needs
    `pip install 'meshforge[tensorboard]'`, else a one-line note). Off by default: the default install leaves
    the tensorboard package out, and `metrics.jsonl` and `report.html` carry the same curves"""
    report: bool = True
    """write the HTML run report `run.dir/report.html` when the run stops (finished, interrupted or failed);
    see [report.md](report.md)"""
    wandb: bool = False
    """also log to Weights & Biases in offline mode (`run.dir/wandb`; `wandb sync` uploads it later); needs the
    `wandb` package, imported only when this is on"""


@dataclass(frozen=True)
class RunConfig:
    """[run]: the run directory."""

    dir: str = ""
    """run directory; empty = `runs/<preset>-<date>-<time>`"""
    overwrite: bool = False
    """allow replacing a run directory that already holds a run, or files meshforge did not write"""


@dataclass(frozen=True)
class HealthConfig:
    """[health]: what happens when a run goes wrong while it keeps running; see [health.md](health.md)."""

    on_nonfinite: Literal["skip", "stop", "rollback"] = "skip"
    """a NaN/Inf loss or gradient norm: `skip` the update on every rank (the batch counts as consumed), `stop` the
    run, or `rollback` to the last complete checkpoint and skip the batches since"""
    max_skipped: int = ranged(whole(0, MAX_STEPS), 10)
    """more bad steps (non-finite, or spikes with skip/rollback) than this in one run stop it"""
    spike_threshold: float = ranged(unit(1e6), 0.0)
    """a loss this many robust deviations (median/MAD) above the recent median is a `loss_spike`; `0` = off (on,
    every step reduces the loss over the ranks)"""
    spike_window: int = ranged(whole(5, 10**6), 50)
    """steps in the running median / MAD"""
    on_spike: Literal["log", "skip", "rollback"] = "log"
    """`log` the spike, `skip` its update, or `rollback` (PaLM's recipe)"""
    hang_timeout_s: float = ranged(Span(1.0, 1e7, also=(0,)), 300.0)
    """no step finished for this long: the ranks compare their last collectives through the rendezvous store,
    write `hang_report.json` and exit so `--max-restarts` can restart; `0` = off"""
    straggler_factor: float = ranged(Span(1.0, 1e6, lo_open=True, also=(0,)), 1.5)
    """on logged steps a rank whose compute time is above this × the median is a `straggler`; `0` = off"""
    text_warn_fraction: float = ranged(unit(lo_open=True), 0.05)
    """byte tokenizer: warn when more than this share of `data.path` is not valid UTF-8"""
    sdc_interval: int = ranged(whole(0, MAX_STEPS), 100)
    """every N steps, compare a fingerprint of each parameter shard across the replicas that must hold it
    bit-identical (data-parallel ranks, HSDP groups, fault-tolerant replica groups: one small all-gather); a
    mismatch is an `sdc` event naming the rank, host and parameter; `0` = off. See
    [health.md](health.md#silent-data-corruption-sdc)"""
    on_sdc: Literal["log", "stop", "rollback"] = "log"
    """what a mismatch does: `log` it, `stop` the run (exit 2), or `rollback` to the last complete checkpoint
    and redo the steps since (needs `checkpoint.interval > 0`)"""


@dataclass(frozen=True)
class ProfileConfig:
    """[profile]: torch.profiler traces of a few steps."""

    start_step: int = ranged(whole(0, MAX_STEPS), 0)
    """first traced step (1-based); `0` = step 3 (past the warm-up)"""
    steps: int = ranged(whole(0, 10**4), 0)
    """steps traced with `torch.profiler` into `run.dir/profile/` (Chrome traces, one per rank; open in
    Perfetto); `0` = no tracing"""
    memory: bool = True
    """on CUDA, also record the traced steps' allocations into `rank-NNNNN-memory.pickle` (open at
    pytorch.org/memory_viz); each allocation then records its stack, host time the traced steps
    pay: `false` when comparing their kernel timeline with another run's (`bench/gpu/kernel_diff.py`)"""


@dataclass(frozen=True)
class DiLoCoConfig:
    """[diloco]: DiLoCo across islands of ranks (`islands` is a layout key); see [diloco.md](diloco.md)."""

    inner_steps: int = ranged(whole(1, MAX_STEPS), 50)
    """H: inner optimizer steps per round before the islands average pseudo-gradients"""
    outer_lr: float = ranged(unit(10.0, lo_open=True), 0.7)
    """outer SGD learning rate (the DiLoCo paper: 0.7)"""
    outer_momentum: float = ranged(unit(hi_open=True), 0.9)
    """outer SGD momentum (the paper: 0.9)"""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD"""
    fragments: int = ranged(whole(1, BLOCKS), 1)
    """Streaming DiLoCo: contiguous block groups synced `inner_steps / fragments` steps apart (`1` = plain DiLoCo)"""
    delay: int = ranged(whole(0, MAX_STEPS), 0)
    """tau: inner steps a fragment's all-reduce overlaps with compute before it is applied
    (`< inner_steps / fragments`)"""
    sync_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    """pseudo-gradients on the wire: `fp32`, `bf16`, or `fp8` (e4m3, a scale per 256 values, error feedback)"""
    warmup_steps: int = ranged(whole(0, MAX_STEPS), 0)
    """steps of plain DDP over all islands (gradients averaged across islands) before the first round; the paper
    starts DiLoCo from a data-parallel-trained model"""


@dataclass(frozen=True)
class FaultToleranceConfig:
    """[fault_tolerance]: replica groups that keep training through a failure (torchft; `replicas` is a layout
    key); see [checkpointing.md](checkpointing.md#live-recovery-fault_tolerance)."""

    enabled: bool = False
    """join the replica groups coordinated by the lighthouse (`meshforge lighthouse`; needs
    `pip install 'meshforge[ft]'`): a group that dies is left behind at the next step, one that starts joins and
    heals from a live peer"""
    lighthouse: str = ""
    """the lighthouse's URL, e.g. `http://10.0.0.1:29510`"""
    replica_id: int = ranged(whole(0, 2**10 - 1), 0)
    """this group's number, `0` .. `replicas - 1`: which slice of every global batch it reads"""
    min_replicas: int = ranged(whole(1, 2**10), 1)
    """live groups a step needs to commit; with fewer the groups wait (up to `quorum_timeout_s`)"""
    quorum_timeout_s: float = ranged(Span(1.0, 1e6), 120.0)
    """how long a group waits for a quorum of `min_replicas` live groups before it gives up (exit 2)"""
    timeout_s: float = ranged(Span(1.0, 1e6), 60.0)
    """a collective across the groups or a healing transfer that takes longer fails the step"""


@dataclass(frozen=True)
class Config:
    """A run's settings as the user gave them (``auto`` and other automatic values still in)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    shape: ModelShape = field(default_factory=lambda: get_preset("debug"))
    layout: Layout = field(default_factory=lambda: Layout(dp_shard=-1))
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
