"""One line of meaning per config key, for ``meshforge train --help``. Generated from the
tables in docs/configuration.md (tests/test_config_help.py fails when they differ; regenerate
with ``python tests/test_config_help.py``)."""

HELP: dict[str, str] = {
    "model.preset": (
        "named shape: debug, debug-moe, llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b, "
        "llama3.1-405b, mixtral-8x7b, qwen3-30b-a3b"
    ),
    "model.hidden": "model width (overrides the preset)",
    "model.layers": "number of transformer blocks",
    "model.heads": "attention heads (must divide hidden)",
    "model.kv_heads": "key/value heads for grouped-query attention (must divide heads)",
    "model.ffn_hidden": "SwiGLU inner width",
    "model.vocab_size": "embedding rows; must be ≥ the tokenizer's vocabulary",
    "model.max_seq_len": "longest sequence the model accepts (train.seq_len must not exceed it)",
    "model.norm_eps": "RMSNorm epsilon",
    "model.tie_embeddings": "share the embedding and output head weights",
    "model.rope_theta": "RoPE base",
    "model.rope_scaling": "none or llama3 (Llama 3.1 long-context frequency scaling)",
    "model.rope_factor": "llama3 scaling factor",
    "model.rope_low_freq_factor": "llama3 scaling: low-frequency band edge",
    "model.rope_high_freq_factor": "llama3 scaling: high-frequency band edge",
    "model.rope_original_max_seq_len": "llama3 scaling: the context length the frequencies were trained for",
    "model.init_std": "std of the normal init (residual output projections get std/√(2·layers))",
    "model.head_dim": (
        "width of one attention head; 0 or unset: hidden / heads (Qwen3 and others set it so that "
        "heads × head_dim ≠ hidden); must be even (RoPE)"
    ),
    "model.qk_norm": "RMSNorm over each head's q and k before RoPE (Qwen3); not yet with parallel.tp > 1",
    "model.num_experts": "mixture of experts ([moe.md](moe.md)): routed experts per MoE block; 0: a dense model",
    "model.experts_per_token": "top-k: experts each token is sent to (1 ≤ k ≤ num_experts)",
    "model.num_shared_experts": "always-on experts of moe_ffn_hidden each, added to every token's output",
    "model.moe_ffn_hidden": "SwiGLU width of one expert; 0: ffn_hidden",
    "model.moe_interval": "every n-th block (counted from first_dense_layers) is MoE, the others dense",
    "model.first_dense_layers": "the first blocks that stay dense",
    "model.router_score": "softmax or sigmoid router scores (fp32)",
    "model.norm_topk": "renormalise the chosen experts' weights to sum to 1",
    "model.capacity_factor": (
        "0: dropless; > 0: each expert takes at most ⌈cf × tokens × k / E⌉ tokens per micro-batch, "
        "the lowest-scoring overflow is dropped (and counted)"
    ),
    "model.load_balance": (
        "aux_loss (Switch/GShard E·Σfᵢ·Pᵢ), bias (DeepSeek-V3 auxiliary-loss-free bias, checkpointed) or none"
    ),
    "model.aux_loss_coeff": 'weight of the balance loss (load_balance = "aux_loss")',
    "model.bias_update_rate": 'bias step per optimizer step, × sign(mean load − load) (load_balance = "bias")',
    "model.z_loss_coeff": "router z-loss weight (mean squared log-sum-exp of the router logits); 0: off",
    "model.init_from": (
        "start from these weights: a meshforge weights dir (e.g. a run's final/) or a Hugging Face "
        "Llama dir; the shape must match"
    ),
    "parallel.dp_replicate": (
        "data-parallel groups that replicate each other (HSDP, with zero_stage 2 or 3); -1 infers it"
    ),
    "parallel.dp_shard": (
        "data-parallel ranks that shard (stages 2/3) or replicate (stages 0/1) within a group; -1 "
        "infers it from the world size"
    ),
    "parallel.tp": (
        "tensor-parallel degree (Megatron column/row; innermost mesh dimension; must divide heads, "
        "kv_heads, ffn_hidden, vocab_size and, under SP, seq_len; at most the ranks per node). See "
        "[parallelism.md](parallelism.md#tensor-parallelism-with-sequence-parallelism)"
    ),
    "parallel.pp": (
        "pipeline-parallel degree (outermost mesh dimension; the layer stack is cut into pp x "
        "pp_virtual_stages chunks). See [parallelism.md](parallelism.md#pipeline-parallelism)"
    ),
    "parallel.cp": (
        "context-parallel degree: each sequence is split over cp ranks, attention runs over a ring "
        "(see [parallelism.md](parallelism.md#context-parallelism)); composes with DDP, ZeRO-1/2/3,"
        " HSDP, tp (+SP) and pp; FSDP and ZeRO-1 shard over dp × cp; seq_len must be a multiple of "
        "2 x cp (zigzag)"
    ),
    "parallel.ep": (
        "expert-parallel degree: each MoE block's experts split over this many data-parallel ranks "
        "(must divide model.num_experts and dp_shard × cp; see [moe.md](moe.md))"
    ),
    "parallel.zero_stage": (
        "0 DDP; 1 optimizer state sharded (fp32: ZeroRedundancyOptimizer; bf16/fp8: bf16 working "
        "state, fp32 master + Adam sharded, 4Ψ + 12Ψ/N, see [precision.md](precision.md)); 2 + "
        "gradients (FSDP2, params kept gathered fwd→bwd); 3 + parameters (FSDP2). Under tp > 1 "
        "every stage runs on FSDP2 (stage 0: replicated parameters, gradients all-reduced) and "
        "stage 1 is refused. See [parallelism.md](parallelism.md)"
    ),
    "parallel.sync_every_microbatch": (
        "reduce gradients on every micro-batch instead of only the last (under ZeRO-2/3: less memory, more traffic)"
    ),
    "parallel.ddp_bucket_mb": "DDP gradient bucket size in MiB (stages 0/1)",
    "parallel.sequence_parallel": (
        "under tp > 1, run norms and residuals on sequence shards (reduce-scatter + all-gather "
        "instead of all-reduce: same bytes, 1/tp of those activations); false: replicated"
    ),
    "parallel.async_tp": (
        "under tp > 1 with sequence parallelism: overlap the tp all-gathers / reduce-scatters with "
        "the GEMMs beside them (async TP, Megatron-Core --tp-comm-overlap); meshforge plan "
        "--tp-overlap prices it. Needs a CUDA device (refused elsewhere); training does not run the"
        " overlap yet"
    ),
    "parallel.pp_schedule": (
        "gpipe, 1f1b, interleaved_1f1b, zero_bubble (interleaved zero bubble), zbv, dualpipev (the "
        "last two where the installed PyTorch has them)"
    ),
    "parallel.pp_virtual_stages": (
        "model chunks per pipeline rank: 1 for gpipe/1f1b, >= 2 for interleaved_1f1b, >= 1 for "
        "zero_bubble, 2 for zbv/dualpipev"
    ),
    "parallel.pp_layers": (
        "blocks per chunk in pipeline order (pp x pp_virtual_stages numbers summing to "
        "model.layers), e.g. [9, 10, 10, 3]; the first and the last may be 0 (a chunk of only the "
        "embedding or only the head, as Llama 3 balanced its stages); empty: balanced by cost (the "
        "embedding and head count as work)"
    ),
    "parallel.cp_balance": (
        "how sequences split over cp ranks: zigzag (2 x cp chunks, rank r holds r and 2cp-1-r: "
        "equal causal work; seq_len a multiple of 2 x cp) or none (contiguous 1/cp; seq_len a "
        "multiple of cp)"
    ),
    "parallel.cp_rotate": (
        "how key/value blocks reach every cp rank: ring (point-to-point to the next rank, one block"
        " at a time) or allgather (all blocks gathered once; cp x the K/V memory)"
    ),
    "parallel.grad_reduce_dtype": (
        "bf16/fp8 ZeRO-1: the dtype gradients are reduce-scattered in: fp32 or bf16 (half the "
        "traffic, bf16 sums). See [precision.md](precision.md)"
    ),
    "parallel.offload": (
        "cpu: FSDP2's CPU offload keeps sharded parameters, gradients and the optimizer step in "
        "host memory (CUDA only; needs zero_stage 2 or 3 with dp > 1; refused on a CPU run: the "
        "state already lives there). See [precision.md](precision.md#cpu-offload)"
    ),
    "parallel.num_microbatches": (
        "pipeline micro-batches per step and dp rank (>= pp; a multiple of the rounds for "
        "interleaving); 0: per-rank batch / train.micro_batch_size, or the largest divisor of the "
        "per-rank batch up to 2 x pp x pp_virtual_stages"
    ),
    "train.steps": "optimizer steps",
    "train.seq_len": "tokens per sequence",
    "train.global_batch_size": "sequences per optimizer step, over all ranks",
    "train.micro_batch_size": "sequences per forward pass per rank; 0 = the whole per-rank batch (no accumulation)",
    "train.seed": "seeds the initial weights (per parameter name) and the data order",
    "train.precision": (
        "auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp8 (bf16 plus fp8 matmuls in the chosen "
        "linears through torchao; emulated on CPU; needs pip install 'meshforge[fp8]'). See "
        "[precision.md](precision.md)"
    ),
    "train.fp8_recipe": (
        "fp8 scaling: tensorwise (one dynamic scale per tensor; fp8 all-gather where FSDP2 shards "
        "over more than one rank, on fp8 GPUs) or rowwise (one per row: more accurate)"
    ),
    "train.fp8_exclude": (
        'module-name patterns (fnmatch, e.g. "layers.0.*") kept in bf16 under fp8; linears with a '
        'dimension not a multiple of 16 always are. Setting it replaces the default (keep "output" '
        "to keep the head in bf16). A pattern that matches nothing is a warning event; one that "
        "leaves no linear in fp8 is refused"
    ),
    "train.mixed_precision": (
        "how bf16/fp8 weights reach the matmuls: auto (cast_once on CUDA, autocast on CPU, where "
        "FSDP2's per-unit host work costs more than the casts), cast_once (FSDP2's mixed-precision "
        "policy casts each fp32 weight to bf16 once per micro-batch and reduces gradients in fp32; "
        "a world of one and DDP's layouts run on FSDP2 for it) or autocast (torch.autocast casts "
        "every weight at every use: the old path). See "
        "[precision.md](precision.md#one-cast-per-step)"
    ),
    "train.activation_checkpoint": "none, full (recompute each block) or selective (keep matmul outputs)",
    "train.loss_chunk_size": (
        "tokens per chunk of the fused head + cross-entropy (only one chunk's logits exist, in fp32"
        " for the softmax); 0 = the plain loss over the full logits. See "
        "[model.md](model.md#chunked-loss)"
    ),
    "train.grad_clip": "global gradient-norm clip; 0 turns it off",
    "train.compile": "torch.compile each block",
    "train.deterministic": "deterministic algorithms; on CPU two runs give bit-identical losses",
    "train.device": "auto, cpu or cuda",
    "train.skip_memory_check": (
        "start even where the pre-flight fit check refuses the run (the planner's estimate exceeds "
        "the GPU's free memory, or on a CPU the RAM available to each local rank). See "
        "[precision.md](precision.md#pre-flight-fit-check)"
    ),
    "train.eval_interval": "evaluate on the validation split every N steps; 0 = only at the end",
    "train.eval_batches": (
        "global batches of validation data per evaluation (the same sequences on every layout); 0 = no evaluation"
    ),
    "optim.name": "optimizer (adamw); no weight decay on norms and embeddings",
    "optim.lr": "peak learning rate",
    "optim.min_lr_ratio": "the decay ends at lr × min_lr_ratio",
    "optim.schedule": "cosine, linear or constant after warmup",
    "optim.warmup_steps": "linear warmup steps; -1 = min(100, steps/10)",
    "optim.decay_steps": "steps over which the decay runs; 0 = the whole run",
    "optim.weight_decay": "AdamW decoupled weight decay",
    "optim.beta1": "Adam β1",
    "optim.beta2": "Adam β2",
    "optim.eps": "Adam ε",
    "optim.implementation": (
        "auto (fused on CUDA and CPU: one kernel per step, no host reads of the step counters; "
        "foreach elsewhere), fused, foreach, for-loop"
    ),
    "data.path": ("empty = the default corpus (Python stdlib sources); else text/dir/JSONL, or a prepared shard dir"),
    "data.tokenizer": "byte or a path to a Hugging Face tokenizer.json",
    "data.val_fraction": "share of the corpus held out for validation",
    "data.cache_dir": "where prepared corpora are cached; empty = $MESHFORGE_CACHE or ~/.cache/meshforge",
    "data.allow_binary": (
        "train on files that are mostly not text (more than 30% of their bytes invalid UTF-8 or "
        "control characters); by default such data is refused with exit 2"
    ),
    "checkpoint.interval": (
        "steps between sharded training checkpoints in run.dir/checkpoints (also one at the end); "
        '0: none; "auto": the Young/Daly optimum √(2 × blocking cost × MTBF). See '
        "[checkpointing.md](checkpointing.md)"
    ),
    "checkpoint.keep": "complete checkpoints to keep; older ones are deleted",
    "checkpoint.async": "write checkpoints in the background (training blocks only for the copy to host memory)",
    "checkpoint.load": (
        "latest: resume from the newest complete checkpoint in run.dir/checkpoints if there is one;"
        " none: never; or a checkpoint directory / checkpoints/ folder (also from another run and "
        "layout)"
    ),
    "checkpoint.mtbf_hours": 'the job\'s mean time between failures, for interval = "auto"',
    "checkpoint.save_final": "write the final weights to run.dir/final (also after Ctrl-C)",
    "checkpoint.export_hf": "also write run.dir/final-hf, a Hugging Face directory",
    "metrics.log_interval": "log step 1, then every N steps and the last (metrics.jsonl, console, TensorBoard)",
    "metrics.console": "progress lines and the summary on stdout",
    "metrics.jsonl": "write metrics.jsonl",
    "metrics.tensorboard": (
        "write TensorBoard event files under run.dir/tensorboard (through torch.utils.tensorboard; "
        "needs pip install 'meshforge[tensorboard]', else a one-line note)"
    ),
    "metrics.report": (
        "write the HTML run report run.dir/report.html when the run stops (finished, interrupted or"
        " failed); see [report.md](report.md)"
    ),
    "metrics.wandb": (
        "also log to Weights & Biases in offline mode (run.dir/wandb; wandb sync uploads it later);"
        " needs the wandb package, imported only when this is on"
    ),
    "run.dir": "run directory; empty = runs/<preset>-<date>-<time>",
    "run.overwrite": "allow replacing a run directory that already holds a run",
    "health.on_nonfinite": (
        "a NaN/Inf loss or gradient norm: skip the update on every rank (the batch counts as "
        "consumed), stop the run, or rollback to the last complete checkpoint and skip the batches "
        "since"
    ),
    "health.max_skipped": "more bad steps (non-finite, or spikes with skip/rollback) than this in one run stop it",
    "health.spike_threshold": (
        "a loss this many robust deviations (median/MAD) above the recent median is a loss_spike; 0"
        " = off (on, every step reduces the loss over the ranks)"
    ),
    "health.spike_window": "steps in the running median / MAD",
    "health.on_spike": "log the spike, skip its update, or rollback (PaLM's recipe)",
    "health.hang_timeout_s": (
        "no step finished for this long: the ranks compare their last collectives through the "
        "rendezvous store, write hang_report.json and exit so --max-restarts can restart; 0 = off"
    ),
    "health.straggler_factor": (
        "on logged steps a rank whose compute time is above this × the median is a straggler; 0 = off"
    ),
    "health.text_warn_fraction": "byte tokenizer: warn when more than this share of data.path is not valid UTF-8",
    "profile.start_step": "first traced step (1-based); 0 = step 3 (past the warm-up)",
    "profile.steps": (
        "steps traced with torch.profiler into run.dir/profile/ (Chrome traces, one per rank; open "
        "in Perfetto); 0 = no tracing"
    ),
    "profile.memory": (
        "on CUDA, also record the traced steps' allocations into rank-NNNNN-memory.pickle (open at "
        "pytorch.org/memory_viz); each allocation then records its stack, host time the traced "
        "steps pay: false when comparing their kernel timeline with another run's "
        "(bench/gpu/kernel_diff.py)"
    ),
    "diloco.islands": (
        "DiLoCo islands (outermost mesh dimension; each runs the [parallel] layout on world / islands ranks); 1 = off"
    ),
    "diloco.inner_steps": "H: inner optimizer steps per round before the islands average pseudo-gradients",
    "diloco.outer_lr": "outer SGD learning rate (the DiLoCo paper: 0.7)",
    "diloco.outer_momentum": "outer SGD momentum (the paper: 0.9)",
    "diloco.nesterov": "Nesterov momentum for the outer SGD",
    "diloco.fragments": (
        "Streaming DiLoCo: contiguous block groups synced inner_steps / fragments steps apart (1 = plain DiLoCo)"
    ),
    "diloco.delay": (
        "tau: inner steps a fragment's all-reduce overlaps with compute before it is applied (< "
        "inner_steps / fragments)"
    ),
    "diloco.sync_dtype": (
        "pseudo-gradients on the wire: fp32, bf16, or fp8 (e4m3, a scale per 256 values, error feedback)"
    ),
    "diloco.warmup_steps": (
        "steps of plain DDP over all islands (gradients averaged across islands) before the first "
        "round; the paper starts DiLoCo from a data-parallel-trained model"
    ),
}
