"""Where one micro-batch's memory peaks, and what is alive there: the saved activations plus the
largest working set that coexists with them (docs/planner.md, "The peak, byte by byte").

A training step's peak is not the end of its forward. Backward works with tensors of its own
beside what forward saved: the gradient flowing down the residual stream, the recomputed block
under activation checkpointing (its whole forward's tensors, however little was kept), a
decomposed norm's temporaries, the SwiGLU's gradients, autocast's bf16 casts, the loss's chunk of
logits, and the parameter gradients allocated so far. So the planner prices each point where the
step can peak and takes the largest:

- ``loss``: the loss's forward (the chunked loss computes the logits' gradients there): every
  saved activation, the step's reference to the model's output and one chunk's logits and their
  gradient (the whole loss: its backward's 14 or 16 bytes per logit, ``memory.loss_bytes``);
- ``final norm backward``: every saved activation, the flowing gradient and the norm's backward;
  on a CPU eager (no fused RMSNorm kernel) its decomposition holds four fp32 rows beside them;
- ``top block backward``: the other blocks' saved activations and the top block's whole forward
  set (kept, or recomputed under selective and full recomputation) with the SwiGLU's gradients;
- ``bottom block backward``: the same for the first block, with every other block's parameter
  gradients allocated instead of their activations (it wins when gradients outweigh a block's
  activations: short sequences, full recomputation);
- ``optimizer step``: every parameter gradient and nothing else.

Measured on a CPU with ``torch.distributed._tools.mem_tracker.MemTracker``
(calibration/peak_probe.py, bench/bench_peak_memory.py, tests/integration/test_peak_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.models.shape import ModelShape
from meshforge.planner.activation_bytes import Holding

# fp32 rows a decomposed RMSNorm's backward (a CPU's eager run) holds beyond the flowing gradient:
# four temporaries, less its normalised input, freed first
DECOMPOSED_NORM_ROWS = 3


@dataclass(frozen=True)
class PeakPoint:
    """One point where a step can peak: bytes of the saved activations alive there, of what
    backward (or the loss) works with there, and of the parameter gradients allocated by then."""

    where: str
    saved: float
    working: float
    grads: float

    @property
    def total(self) -> float:
        return self.saved + self.working + self.grads


@dataclass(frozen=True)
class StepTensors:
    """One micro-batch's tensors on one rank, in bytes (planner/memory.py fills them in)."""

    layers: int  # blocks on this rank
    block: float  # one block's saved activations in the run's recomputation mode
    block_whole: float  # one block's whole forward set (what no recomputation keeps)
    first_ends: float  # token ids and RoPE tables (alive from the start of forward to its end)
    last_ends: float  # the final norm's and the loss's saved tensors
    output: float  # the model's output the step holds until backward ends (hidden states or logits)
    dy: float  # the gradient flowing down the residual stream
    norm_working: float  # the final norm's backward beyond the flowing gradient
    block_working: float  # a block's backward beyond its whole forward set and the flowing gradient
    recomputed_copies: float  # autocast's bf16 weight copies a recomputed block casts again
    loss_working: float  # the loss's own working set beyond what it saves
    loss_replaces_saved: float  # saved bytes the whole loss's working set already counts
    loss_saved: float = 0.0  # the loss's saved tensors (in last_ends), freed once its backward ran
    block_grad_share: float = 0.0  # share of the gradients a block's backward has allocated at its peak


def points(t: StepTensors, grads: float, grad_shares: dict[str, float]) -> list[PeakPoint]:
    """Every candidate peak of one micro-batch (see the module doc). ``grads``: all parameter
    gradient bytes; ``grad_shares``: the share of them allocated at ``loss``, ``top``, ``bottom``."""
    n = t.layers
    kept = n * t.block + t.first_ends
    recomputed = t.block_whole - t.block + t.recomputed_copies  # nothing under no recomputation
    top_work = recomputed + t.block_working + t.dy + t.output
    return [
        PeakPoint(
            "loss", kept + t.last_ends - t.loss_replaces_saved, t.output + t.loss_working, grads * grad_shares["loss"]
        ),
        PeakPoint(
            "final norm backward",
            kept + t.last_ends - t.loss_saved,
            t.output + t.dy + t.norm_working,
            grads * grad_shares["loss"],
        ),
        PeakPoint("top block backward", kept, top_work, grads * (grad_shares["top"] + t.block_grad_share)),
        PeakPoint(
            "bottom block backward",
            t.block + t.first_ends,
            top_work,
            grads * (grad_shares["bottom"] + t.block_grad_share),
        ),
        PeakPoint("optimizer step", 0.0, 0.0, grads),
    ]


def swiglu_moment(shape: ModelShape, hold: Holding, tp: int, sp: bool) -> bool:
    """Whether a block's backward peaks in the SwiGLU's backward (w2's weight gradient taken), not
    as w2's backward starts (``block_working_per_token``)."""
    split = tp if sp else 1
    return not hold.autocast or 2 * hold.bpe * shape.ffn_hidden / tp >= (hold.bpe + hold.resid) * shape.hidden / split


def block_working_per_token(shape: ModelShape, hold: Holding, recompute: str, eager: bool, tp: int, sp: bool) -> float:
    """Per token, a block's backward beyond its whole forward set and the flowing gradient, at the
    larger of two moments. In the SwiGLU's backward: the product's gradient and the gate's and
    up's gradients beside it, less the product (freed once w2's weight gradient is taken): 2·b·f.
    Under autocast, as w2's backward starts: the flowing gradient cast to bf16 (b·h) and the fp32
    output of the MLP's norm, alive beside its bf16 casts (r·h). Eager selective recomputation
    also holds w2's kept output (b·h) beside its recomputed block."""
    split = tp if sp else 1
    mlp = 2 * hold.bpe * shape.ffn_hidden / tp
    cast = (hold.bpe + hold.resid) * shape.hidden / split if hold.autocast else 0.0
    extra = hold.bpe * shape.hidden / split if recompute == "selective" and eager else 0.0
    return max(mlp, cast) + extra


def norm_working_per_token(shape: ModelShape, hold: Holding, fused: bool, tp: int, sp: bool) -> float:
    """Per token, the final norm's backward beyond what is saved and the flowing gradient (the
    loss's saved tensors are freed by then): a fused kernel (a GPU) its input
    gradient (r·h); decomposed (a CPU, where F.rms_norm runs op by op, compiled or not: the final
    norm is outside the compiled blocks) ``DECOMPOSED_NORM_ROWS`` fp32 rows."""
    split = tp if sp else 1
    if fused:
        return hold.resid * shape.hidden / split
    return DECOMPOSED_NORM_ROWS * 4 * shape.hidden / split


def chunk_working(rows: float, vocab_local: float, hidden: float, chunk: int, bpe: int) -> float:
    """The chunked loss's forward working set beyond the hidden states' and the head's gradients:
    one chunk's fp32 logits (their gradient in place) and the chunk's input gradient (fp32: 4·V + 4·h
    a row); in bf16 the bf16 logits cast to fp32 beside them and the gradient cast back (6·V + 2·h)."""
    c = min(rows, chunk)
    return c * (4 * vocab_local + 4 * hidden) if bpe == 4 else c * (6 * vocab_local + 2 * hidden)
