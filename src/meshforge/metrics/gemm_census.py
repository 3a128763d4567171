"""GEMM census: every matmul-like op a training step really runs, with its shape, dtypes, operand
layouts and FLOPs, sorted into kinds, next to what ``models/flops.py`` says the step should cost.

MFU divides ``models/flops.py``'s count (6N·T plus attention) by time; this checks the numerator
against what runs, so work beyond it (a head computed twice, a recomputation nobody asked for, a
weight gradient taken in two GEMMs) shows up as FLOPs, not as a slower step to guess at.

How ops are seen: a ``TorchDispatchMode`` around the step. Eager steps dispatch every aten op to
it. Compiled graphs do too for what inductor leaves to aten: on CPU and CUDA the matmuls are
``extern_kernels.mm/addmm/bmm`` calls (``aten.mm.out`` ...) and SDPA a fallback kernel; the mode
says ``ignore_compile_internals``, so torch.compile still compiles (it skips a frame run under
any other mode) and the mode sees the compiled artifact's aten calls at run time. A matmul that
inductor turns into its own kernel (a max-autotune template, a tiny mm decomposed into pointwise
code, a compiled flex attention) is invisible to it: enter the mode only after a warm-up call,
and compare the total with ``expected_flops``. ``torch.utils.flop_counter.FlopCounterMode`` is
no substitute: it misses in-place ``addmm_`` (the fp32 chunked loss's head gradient) and has no
formula for the CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``).

Kinds, from the op, the phase (inside autograd's backward or not) and the shapes (``ModelDims``):
``forward`` (x @ W^T), ``input_grad`` (dy @ W), ``weight_grad`` (dy^T @ x, contracting over the
tokens), ``recompute`` (a forward GEMM run again during backward: activation checkpointing),
``head`` (any GEMM with a vocabulary-sized dimension: forward, input and weight gradient; the
chunked loss computes all three in its forward), and the attention core: ``attention`` (forward),
``attention_grad`` and ``attention_recompute``. FLOPs follow models/flops.py: 2mkn per matmul;
attention over the full seq x seq square, 4·b·h·s·s·d forward and twice that backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from meshforge.models import flops

aten = torch.ops.aten
# (op packet) -> index of the first matmul operand (addmm / baddbmm take the added tensor first)
_MATMULS = {aten.mm: 0, aten.bmm: 0, aten.addmm: 1, aten.addmm_: 1, aten.baddbmm: 1, aten.baddbmm_: 1}
_MATMULS |= {aten._scaled_mm: 0, aten.linear: 0, aten.matmul: 0, aten._addmm_activation: 1}
# SDPA-level attention kernels: q, k, v (batch, heads, seq, head_dim) first (backward: grad_out first)
_ATTENTION = {
    aten._scaled_dot_product_flash_attention: 0,
    aten._scaled_dot_product_flash_attention_for_cpu: 0,
    aten._scaled_dot_product_efficient_attention: 0,
    aten._scaled_dot_product_cudnn_attention: 0,
    aten._scaled_dot_product_fused_attention_overrideable: 0,
    aten._scaled_dot_product_flash_attention_backward: 1,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: 1,
    aten._scaled_dot_product_efficient_attention_backward: 1,
    aten._scaled_dot_product_cudnn_attention_backward: 1,
    aten._scaled_dot_product_fused_attention_overrideable_backward: 1,
}
_CASTS = {aten._to_copy, aten.clone}  # copies before a GEMM worth naming (dtype casts, layout copies)
_DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4m3"}
_DT |= {torch.float8_e5m2: "fp8e5m2"}
KINDS = (
    *("forward", "input_grad", "weight_grad", "recompute", "head"),
    *("attention", "attention_grad", "attention_recompute", "other"),
)


def _dt(t: torch.Tensor) -> str:
    return _DT.get(t.dtype, str(t.dtype).removeprefix("torch."))


def _layout(t: torch.Tensor) -> str:
    """N: row-major over the last two dims; T: a transposed view (column-major); S: other strides."""
    if t.dim() < 2:
        return "N"
    s0, s1 = t.stride(-2), t.stride(-1)
    if s1 == 1 and s0 >= t.shape[-1]:
        return "N"
    if s0 == 1 and s1 >= t.shape[-2]:
        return "T"
    return "S"


@dataclass(frozen=True)
class ModelDims:
    """What tells the kinds apart: the block linears' weight shapes (out, in), the vocabulary, the
    head's input width and the token counts a micro-batch's activations have as rows."""

    weights: frozenset[tuple[int, int]]
    vocab: int
    hidden: int
    tokens: frozenset[int]

    @staticmethod
    def of_model(model: nn.Module, vocab: int, tokens: Iterable[int]) -> ModelDims:
        """From a model's ``nn.Linear`` weights (the head is the one with ``vocab`` rows)."""
        shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
        hidden = next(s[1] for s in shapes if s[0] == vocab)
        dims = ModelDims(frozenset(s for s in shapes if vocab not in s), vocab, hidden, frozenset(tokens))
        clash = dims.tokens & {d for s in dims.weights for d in s} | dims.tokens & {vocab, hidden}
        if clash:  # a token count equal to a weight dimension makes x @ W^T and dy^T @ x look alike
            raise ValueError(f"token counts {sorted(clash)} equal a model dimension: pick another batch x seq")
        return dims

    def is_weight(self, shape: tuple[int, ...]) -> bool:
        """A block linear's or the head's weight shape (or its transpose)."""
        w = self.weights | {(self.vocab, self.hidden)}
        return len(shape) == 2 and (shape in w or shape[::-1] in w)

    def kind(self, m: int, k: int, n: int, b_layout: str, backward: bool) -> str:
        """The kind of an (m, k) @ (k, n) matmul."""
        if self.vocab in (m, k, n):
            return "head"
        w, rows = self.weights, m in self.tokens
        square = (n, k) in w and (k, n) in w  # x @ W^T and dy @ W have one shape: W^T is the transposed view
        if rows and (n, k) in w and (not square or b_layout == "T"):
            return "recompute" if backward else "forward"
        if rows and (k, n) in w:
            return "input_grad"
        if k in self.tokens and ((m, n) in w or (n, m) in w):
            return "weight_grad"
        return "other"

    def head_part(self, m: int, k: int, n: int) -> str:
        """Which of the head's three GEMMs: forward (.., H) @ (H, V), input grad (.., V) @ (V, H), weight grad."""
        if k == self.vocab:
            return "input grad"
        if n == self.vocab and k == self.hidden and m not in (self.hidden, self.vocab):
            return "forward"
        return "weight grad"


@dataclass
class Gemm:
    """One matmul-like call: op, kind, phase, (batch, m, k, n) or attention (b, hq, hkv, sq, sk, d),
    operand and output dtypes, operand layouts, FLOPs, and what happened around it (notes)."""

    op: str
    kind: str
    phase: str
    dims: tuple[int, ...]
    dtypes: str = ""
    layout: str = ""
    flops: int = 0
    notes: list[str] = field(default_factory=list)

    def key(self) -> tuple:
        return (self.kind, self.op, self.dims, self.dtypes, self.layout, tuple(self.notes))


def _matmul_dims(func: Any, args: tuple, first: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Operands and (batch, m, k, n) of a matmul call (linear's weight is (n, k): its k, n swap)."""
    a, b = args[first], args[first + 1]
    if func.overloadpacket is aten.linear:
        lead = a.shape[:-1].numel()
        return a, b, (1, lead, a.shape[-1], b.shape[0])
    if a.dim() == 3 or b.dim() == 3:
        return a, b, (a.shape[0], a.shape[-2], a.shape[-1], b.shape[-1])
    return a, b, (1, a.shape[-2], a.shape[-1], b.shape[-1])


class GemmCensus(TorchDispatchMode):
    """Records every matmul-like call while active (``records``); ``dims`` sorts them into kinds
    (without it every GEMM is ``other``). One census may span several steps or calls."""

    def __init__(self, dims: ModelDims | None = None) -> None:
        super().__init__()
        self.dims = dims
        self.records: list[Gemm] = []
        self._copied = WeakIdKeyDictionary()  # tensor -> how a cast or copy made it
        self._made = WeakIdKeyDictionary()  # GEMM output -> its record
        self.unseen: set[str] = set()  # higher-order ops run without the census seeing inside

    supports_higher_order_operators = True  # compiled checkpointing wraps SDPA in RNG-state ops

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while torch.compile traces (which it would otherwise skip), on for what it runs."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, HigherOrderOperator):
            self._higher_order(func.name(), args, kwargs, out)
        else:
            self._record(func, args, kwargs, out)
        return out

    def _higher_order(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """The op a compiled graph's RNG wrapper runs (SDPA under checkpointing: its forward and its
        recomputation are ``run_and_save_rng_state`` / ``run_with_rng_state(state, op, ...)``), flex
        attention; any other higher-order op runs unseen inside, and is named in ``unseen``."""
        at = {"run_and_save_rng_state": 0, "graphsafe_run_with_rng_state": 0, "run_with_rng_state": 1}.get(name)
        if at is not None:
            inner = {k: v for k, v in kwargs.items() if k != "rng_state"}
            self._record(args[at], args[at + 1 :], inner, out[1] if name == "run_and_save_rng_state" else out)
        elif name in ("flex_attention", "flex_attention_backward"):
            self._attention(name, args[0], args[1])
        else:
            self.unseen.add(name)

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        packet = func.overloadpacket
        self._note_consumers(packet, args, out)
        if packet in _MATMULS:
            self._matmul(func, args, kwargs, out, _MATMULS[packet])
        elif packet in _ATTENTION:
            qi = _ATTENTION[packet]
            self._attention(packet.__name__, args[qi], args[qi + 1])
        elif packet in _CASTS and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self._note_copy(packet.__name__, args[0], out)

    def _note_copy(self, op: str, src: torch.Tensor, out: torch.Tensor) -> None:
        """Remember a layout copy of any tensor, or a dtype cast of a weight (an activation's cast
        back after a norm is part of the norm, not of the GEMM it feeds)."""
        if src.dtype == out.dtype:
            self._copied[out] = f"{op} {_layout(src)}->{_layout(out)}"
        elif self.dims is None or self.dims.is_weight(tuple(src.shape)):
            self._copied[out] = f"{op} {_dt(src)}->{_dt(out)}"

    def _matmul(self, func: Any, args: tuple, kwargs: dict, out: Any, first: int) -> None:
        a, b, (bat, m, k, n) = _matmul_dims(func, args, first)
        backward = torch._C._current_graph_task_id() != -1
        res = out if isinstance(out, torch.Tensor) else kwargs.get("out")
        kind = "other"
        if bat > 1:  # batched: the model's only batched matmuls are a math-path attention's
            kind = "attention_grad" if backward else "attention"
        elif self.dims is not None:
            kind = self.dims.kind(m, k, n, _layout(b), backward)
        lay_b = "T" if func.overloadpacket is aten.linear else _layout(b)  # linear transposes its weight
        dtypes = f"{_dt(a)} x {_dt(b)} -> {_dt(res) if res is not None else '?'}"
        rec = Gemm(func.overloadpacket.__name__, kind, "backward" if backward else "forward", (bat, m, k, n))
        rec.dtypes, rec.layout, rec.flops = dtypes, f"{_layout(a)} x {lay_b}", 2 * bat * m * k * n
        if kind == "head" and self.dims is not None:
            rec.notes.append("head " + self.dims.head_part(m, k, n))
        if func.overloadpacket in (aten.addmm_, aten.baddbmm_):
            rec.notes.append("in place: accumulates into its output")
        for i, t in ((0, a), (1, b)):
            how = self._copied.get(t) or (self._copied.get(t._base) if t._base is not None else None)
            if how:
                rec.notes.append(f"operand {i} made by {how}")
        if res is not None:
            self._made[res] = rec
        self.records.append(rec)

    def _attention(self, name: str, q: torch.Tensor, k: torch.Tensor) -> None:
        """An attention kernel over q (b, hq, sq, d) and k (b, hkv, sk, d): the full square's FLOPs."""
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        backward = torch._C._current_graph_task_id() != -1
        grad = name.endswith("_backward")
        kind = "attention_grad" if grad else ("attention_recompute" if backward else "attention")
        rec = Gemm(name, kind, "backward" if backward else "forward", (b, hq, hkv, sq, sk, d))
        rec.dtypes, rec.layout = f"{_dt(q)} q/k/v", "BHSD"
        rec.flops = (8 if grad else 4) * b * hq * sq * sk * d
        self.records.append(rec)

    def _note_consumers(self, packet: Any, args: tuple, out: Any) -> None:
        """A GEMM's output cast (``_to_copy``) or added in place (``add_``) into another dtype."""
        if packet not in (aten._to_copy, aten.add_, aten.copy_):
            return
        dst = args[0] if packet is not aten._to_copy else out
        for t in tree_flatten(args[1:] if packet is not aten._to_copy else args[:1])[0]:
            if not isinstance(t, torch.Tensor):
                continue
            rec = self._made.get(t) or (self._made.get(t._base) if t._base is not None else None)
            if rec is not None and isinstance(dst, torch.Tensor) and dst.dtype != t.dtype:
                note = f"output {packet.__name__} into {_dt(dst)}"
                if note not in rec.notes:
                    rec.notes.append(note)

    def totals(self) -> dict[str, int]:
        """FLOPs per kind (every kind present, 0 where none ran)."""
        out = dict.fromkeys(KINDS, 0)
        for r in self.records:
            out[r.kind] += r.flops
        return out

    def rows(self) -> list[tuple[tuple, int, int]]:
        """(key, calls, FLOPs) per distinct GEMM (kind, op, dims, dtypes, layout, notes), in kind order."""
        acc: dict[tuple, list[int]] = {}
        for r in self.records:
            c = acc.setdefault(r.key(), [0, 0])
            c[0] += 1
            c[1] += r.flops
        return sorted(((k, c, f) for k, (c, f) in acc.items()), key=lambda x: (KINDS.index(x[0][0]), -x[2]))


def expected_flops(shape: Any, tokens: int, seq_len: int, recompute: str = "none") -> dict[str, float]:
    """What one micro-batch of ``tokens`` tokens (sequences of ``seq_len``) should cost per kind, from
    models/flops.py: the blocks' matmuls 2N·T each in forward, input and weight gradient, the head
    6·V·H·T, the attention core 4·L·s·h·d·T forward and twice that backward. ``recompute`` (the
    blocks' activation checkpointing): full runs the blocks' forward again but for each block's last
    GEMM (w2: backward never reads its output, and torch's checkpoint stops recomputing once backward
    has what it needs, as the compiler's partitioner recomputes only what backward reads), selective
    the attention core; ``flops.recomputed_matmul_params`` is that count, which HFU
    (``flops.hardware_flops_per_token``) and the planner use. A dense model (an MoE block's routing
    makes its GEMMs data-dependent)."""
    blocks = 2.0 * flops.block_matmul_params(shape) * shape.layers * tokens
    recomputed = 2.0 * flops.recomputed_matmul_params(shape) * tokens
    attn = flops.attention_flops_per_token(shape, seq_len) * tokens
    out = dict.fromkeys(KINDS, 0.0)
    out |= {"forward": blocks, "input_grad": blocks, "weight_grad": blocks}
    out |= {"head": flops.head_flops_per_token(shape) * tokens, "attention": attn, "attention_grad": 2 * attn}
    if recompute == "full":
        out |= {"recompute": recomputed, "attention_recompute": attn}
    elif recompute == "selective":
        out["attention_recompute"] = attn
    return out
