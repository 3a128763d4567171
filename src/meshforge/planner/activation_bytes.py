"""What a Llama block, and the model around the blocks, keep for backward per token: the
tensors meshforge's model saves, counted one by one, as ``calibration/activation_probe.py``
measures them (held equal within 3% by tests/integration/test_activation_bytes.py; docs/planner.md
lists where each byte comes from).

How a run holds its tensors (``Holding``): the matmuls' inputs and outputs in the compute
dtype (``bpe``: 4 in fp32, 2 in bf16); the residual stream in fp32 under autocast over fp32
weights (``resid`` 4) or in bf16 when FSDP2's mixed precision runs the whole block in bf16
(cast once, or any FSDP2 layout in bf16: ``resid`` 2); under autocast every consumer of an
fp32 tensor gets its own bf16 copy; FSDP2 casts each block's floating inputs, so each block
keeps its own bf16 RoPE tables. Whether the block is compiled decides what is recomputed:
inductor's partitioner keeps a matmul's output over the element-wise chain behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.models.shape import ModelShape

TOKEN_ID_BYTES = 8  # int64 token ids: the embedding's indices and the targets, one tensor of the batch


@dataclass(frozen=True)
class Holding:
    """How a layout's blocks hold their tensors (see the module doc)."""

    bpe: int  # the matmuls' inputs and outputs
    resid: int  # the residual stream
    autocast: bool  # fp32 weights cast at every use: each consumer of an fp32 tensor its own bf16 copy
    unit_cast: bool  # FSDP2's mixed precision casts each block's inputs (its own bf16 RoPE tables)


def holding(precision: str, fsdp: bool) -> Holding:
    """fp32; bf16/fp8 under autocast over fp32 weights; or bf16/fp8 on FSDP2 (cast once, sharded)."""
    if precision not in ("bf16", "fp8"):
        return Holding(4, 4, False, False)
    return Holding(2, 2, False, True) if fsdp else Holding(2, 4, True, False)


def rope_bytes_per_token(shape: ModelShape, bpe: int = 4) -> float:
    """cos and sin, (seq, head_dim) each: fp32 and shared by every block, or each block's bf16 cast."""
    return 2 * shape.head_dim * bpe


def block_bytes_per_token(
    shape: ModelShape, hold: Holding, recompute: str, eager: bool, tp: int = 1, sp: bool = False
) -> float:
    """Bytes one block keeps per token of a micro-batch. Parts along the residual stream (the
    block input, norms, the output projection's output) split over tp only under sequence
    parallelism; heads and MLP columns always. Full recomputation keeps the block input (and
    its RoPE tables where the block casts its own); selective keeps the input and the matmul
    outputs the backward needs (q, k, v, the attention and MLP projections' outputs); without
    recomputation see ``_whole_block``."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_hidden
    split = tp if sp else 1
    rope = rope_bytes_per_token(shape, hold.bpe) if hold.unit_cast else 0.0
    if recompute == "full":
        return hold.resid * h / split + rope
    if recompute == "selective":  # q, wo's output (and, eager, w2's: kept though unused), k, v, w1, w3
        whole = hold.resid * h + hold.bpe * h * (2 if eager else 1)
        return whole / split + hold.bpe * (h + 2 * kv + 2 * f) / tp + rope
    whole, sharded = _whole_block(shape, hold, eager)
    return whole / split + sharded / tp + rope


def _whole_block(shape: ModelShape, hold: Holding, eager: bool) -> tuple[float, float]:
    """No recomputation: (residual-stream bytes, head/column bytes) per token. Both: each norm's
    fp32 rstd (4 bytes); attention keeps q, k, v, its output and an fp32 log-sum-exp per head.
    Compiled (inductor's partition): the block input, each norm's output (the next matmul's
    input), the output projection's output (the second norm's input is recomputed from it), and
    the MLP's gate and up outputs and their product (SiLU recomputed). Eager: each norm keeps its
    fp32 input (the residual itself, or an fp32 copy of a bf16 one), its fp32 normalised value
    and its output — under autocast an fp32 output cast once per consumer (3 for q/k/v, 2 for
    gate/up) —, and the MLP SiLU's output too."""
    h, kv, f, a = shape.hidden, shape.kv_dim, shape.ffn_hidden, shape.heads
    b = hold.bpe
    sharded = b * (2 * h + 2 * kv) + 4 * a + (4 if eager else 3) * b * f
    if not eager:
        return hold.resid * h + 3 * b * h + 8, sharded
    if hold.autocast:
        outputs = 5 * b * h  # 3 + 2 bf16 casts of the fp32 norm outputs
    else:
        outputs = 2 * b * h  # each norm's output in the compute dtype
    return 2 * (4 * h + 4 * h + 4) + outputs, sharded


def ends_bytes_per_token(
    shape: ModelShape, hold: Holding, loss_chunk_size: int, eager: bool, tp: int = 1, sp: bool = False
) -> float:
    """Per token, what the model keeps outside its blocks: the token ids, the fp32 RoPE tables
    every block shares (FSDP2's blocks keep casts of their own instead), the final norm (run
    eager: its fp32 input, rstd and normalised value, and its output where the head's matmul
    keeps it, i.e. not under the chunked loss) and the loss's own saved tensors
    (``loss_saved_bytes_per_token``)."""
    h = shape.hidden
    rope = 0.0 if hold.unit_cast else rope_bytes_per_token(shape)
    norm = 8 * h + 4 + (hold.bpe * h if loss_chunk_size <= 0 else 0)  # (autocast: the head's one bf16 cast)
    split = tp if sp else 1
    return TOKEN_ID_BYTES + rope + norm / split + loss_saved_bytes_per_token(shape, hold, loss_chunk_size, eager, tp)


def loss_saved_bytes_per_token(
    shape: ModelShape, hold: Holding, loss_chunk_size: int, eager: bool, tp: int = 1
) -> float:
    """The loss's saved tensors per token. Full logits: eager, the fp32 log-softmax (4 bytes per
    logit of this rank's vocabulary); compiled, the logits in the compute dtype and the rows' fp32
    max and log-sum-exp. Chunked (eager or compiled: its loop runs outside compiled graphs), the
    hidden states' gradient, computed in forward in the final norm's output dtype (the head's
    fp32 gradient is fixed, not per token)."""
    if loss_chunk_size <= 0:
        return 4 * shape.vocab_size / tp if eager else hold.bpe * shape.vocab_size / tp + 8
    return shape.hidden * hold.resid
