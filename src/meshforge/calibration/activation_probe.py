"""Saved activation bytes of a run's own model, per block and per token, measured on a world of
one (``saved_activations.py`` does the counting).

The model is built as ``meshforge train`` builds it — ``parallelize`` with the run's config:
activation checkpointing, ``torch.compile`` of the blocks, bf16 by autocast or cast once by
FSDP2 on a one-rank mesh, the chunked or the plain loss — and one micro-batch goes forward
through the run's forward context and loss. A block's bytes are what a model with one more
block keeps more, and a token's what one more token costs, so nothing is attributed by hand:
the RoPE tables every block shares, the embedding, the final norm and the loss cancel out of
the per-block figure and make up the ``ends``. Used by bench/bench_activation_bytes.py and
tests/integration/test_activation_bytes.py against the planner's ``planner/activation_bytes.py``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from meshforge.calibration.saved_activations import SavedReport, measure
from meshforge.config import load_config
from meshforge.config.run_plan import RunPlan

# the run settings that decide what a block keeps (config keys, as `meshforge train` takes them)
MODE_KEYS = (
    "train.activation_checkpoint",
    "train.compile",
    "train.precision",
    "train.mixed_precision",
    "train.loss_chunk_size",
)


@dataclass
class Measured:
    """Bytes kept for backward by one micro-batch of ``tokens`` through ``layers`` blocks."""

    layers: int
    tokens: int
    total: int
    report: SavedReport


@dataclass
class PerBlock:
    """The fit of four measurements (two depths x two lengths): bytes = ends + layers x block,
    each linear in the tokens (``per_token`` + ``fixed``)."""

    block_per_token: float
    block_fixed: float
    ends_per_token: float
    ends_fixed: float
    runs: list[Measured]

    def block(self, tokens: int) -> float:
        return self.block_fixed + self.block_per_token * tokens

    def ends(self, tokens: int) -> float:
        return self.ends_fixed + self.ends_per_token * tokens


def run_config(overrides: dict[str, Any], layers: int, seq: int) -> RunPlan:
    """The world-of-one run plan of ``overrides`` at ``layers`` blocks and ``seq`` tokens (one sequence)."""
    from meshforge.resolve import resolve

    base = {"train.global_batch_size": 1, "train.micro_batch_size": 1, "train.device": "cpu"}
    cfg = load_config(None, {**base, **overrides, "model.layers": layers, "train.seq_len": seq})
    return resolve(cfg, 1)


@contextlib.contextmanager
def _compile_backend(backend: str | None) -> Iterator[None]:
    """``torch.compile`` (the blocks' and the loss's) with ``backend`` instead of inductor:
    ``partition_only`` gives inductor's own partition without generating code (see below)."""
    if backend is None:
        yield
        return
    chosen = partition_only_backend() if backend == "partition_only" else backend
    original = torch.compile

    def compile_with(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "backend": chosen, "dynamic": DYNAMIC})

    torch.compile = compile_with
    try:
        yield
    finally:
        torch.compile = original


DYNAMIC = None


@functools.cache
def partition_only_backend() -> Callable[..., Any]:
    """Inductor's own graph passes and partition of the joint graph (so the very tensors its
    forward saves), with the forward and backward graphs then run as they are instead of
    generating C++/Triton code: the saved set in seconds rather than a compile per shape."""
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.output_code import MockFXGraphCacheOutput

    def run_as_is(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        return MockFXGraphCacheOutput(make_boxed_func(gm.forward))

    return functools.partial(compile_fx, inner_compile=run_as_is)


def measure_run(plan: RunPlan, backend: str | None = None) -> Measured:
    """Build ``plan``'s model on a world of one as training does and measure one forward + loss."""
    from meshforge.models.llama import build_model
    from meshforge.parallel.compile import compile_loss
    from meshforge.parallel.mesh import Mesh
    from meshforge.parallel.parallelize import build_loss, forward_context, parallelize

    mesh = Mesh(0, 1, 0, torch.device("cpu"), plan.layout)
    shape = plan.shape
    loss, context = build_loss(plan), forward_context(plan, mesh.device)
    with _compile_backend(backend):
        model = parallelize(build_model(shape, device="meta"), plan, mesh, seed=0)
        loss_fn = compile_loss(loss) if plan.train.compile else loss  # as the step runs it (train/step.py)
    gen = torch.Generator().manual_seed(0)
    seq = plan.train.seq_len
    tokens = torch.randint(0, shape.vocab_size, (1, seq + 1), generator=gen)
    positions = torch.arange(seq)
    weights = [*model.parameters(), *model.buffers()]

    def forward() -> torch.Tensor:
        with loss.context():
            with context():
                out = model(tokens[:, :-1], positions)
            return loss_fn(out, tokens[:, 1:], model)

    report = measure(forward, weights, eager=not plan.train.compile, after=model.parameters)
    return Measured(shape.layers, seq, report.total, report)


def per_block(
    overrides: dict[str, Any], seqs: tuple[int, int] = (192, 320), depths: tuple[int, int] = (1, 2), **kw: Any
) -> PerBlock:
    """Measure at two depths and two lengths and split the bytes into blocks and ends, each a
    per-token and a fixed part (the fit is exact: four measurements, four unknowns)."""
    torch._dynamo.reset()  # each mode compiles afresh (a new mode is no recompile of the last)
    runs = [measure_run(run_config(overrides, n, s), **kw) for n in depths for s in seqs]
    (a, b), (c, d) = [(r.total for r in runs[i : i + 2]) for i in (0, 2)]
    dn, ds = depths[1] - depths[0], seqs[1] - seqs[0]
    block_tok = ((d - c) - (b - a)) / (dn * ds)
    block_fixed = (c - a) / dn - block_tok * seqs[0]
    ends_at_0 = a - depths[0] * (block_fixed + block_tok * seqs[0])
    ends_tok = ((b - a) / ds) - depths[0] * block_tok
    return PerBlock(block_tok, block_fixed, ends_tok, ends_at_0 - ends_tok * seqs[0], runs)


def planned(plan: RunPlan) -> tuple[float, float]:
    """The planner's (block, ends) bytes per token for ``plan``'s run (planner/activation_bytes.py)."""
    from meshforge.planner import activation_bytes as ab

    t, shape = plan.train, plan.shape
    hold = ab.holding(t.precision, plan.fsdp)
    eager = not t.compile
    block = ab.block_bytes_per_token(shape, hold, plan.layout.activation_checkpoint, eager)
    return block, ab.ends_bytes_per_token(shape, hold, t.loss_chunk_size, eager)


def mode_overrides(base: dict[str, Any], **mode: Any) -> dict[str, Any]:
    """``base`` with a mode's settings, named by their keys less the section (``compile=True``)."""
    keys = {k.split(".", 1)[1]: k for k in MODE_KEYS}
    return {**base, **{keys[k]: v for k, v in mode.items()}}
