"""Block attention kernels for ring attention: one query block over one key/value block,
returning the log-sum-exp the ring needs to merge partial outputs, and the matching backward.

This is the one place that calls PyTorch's private SDPA ops (their names and signatures
change between releases):

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), fp32/fp64/
  bf16/fp16, grouped-query attention without repeating K/V;
- CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16/bf16, head_dim <= 256, a
  multiple of 8) or ``aten._scaled_dot_product_efficient_attention`` (fp32 too); K/V heads
  are repeated for GQA there.

Anything else — an op missing from the installed torch, a dtype, shape or device a kernel
refuses — falls back to ``math``: the same computation written with matmuls in fp32.
The backward of every kernel takes the *merged* output and log-sum-exp of the whole ring
(so a block's probabilities are exp(s - lse_total)), which is what makes it exact; it
needs nothing from the block's own forward, so forward and backward may use different
kernels.
"""

from __future__ import annotations

from typing import Any

import torch

KERNELS = ("auto", "math")  # "auto": the fastest op this torch has for the inputs, else math

_aten = torch.ops.aten
_CPU = "_scaled_dot_product_flash_attention_for_cpu"
_CUDA_FLASH = "_scaled_dot_product_flash_attention"
_CUDA_EFFICIENT = "_scaled_dot_product_efficient_attention"


def _has(name: str) -> bool:
    return hasattr(_aten, name) and hasattr(_aten, name + "_backward")


def pick_kernel(q: torch.Tensor, kind: str = "auto") -> str:
    """Which kernel runs a block of ``q``'s device, dtype and head_dim (``math`` when none fits)."""
    if kind == "math":
        return "math"
    d = q.shape[-1]
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "flash_cpu" if _has(_CPU) else "math"
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0 and _has(_CUDA_FLASH):
            return "flash_cuda"
        if q.dtype in (torch.float32, torch.float16, torch.bfloat16) and d % 8 == 0 and _has(_CUDA_EFFICIENT):
            return "efficient_cuda"
    return "math"


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each kv head for its query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def reduce_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of expand_kv: sum over each kv head's query heads."""
    b, h, s, d = t.shape
    return t if h == kv_heads else t.reshape(b, kv_heads, h // kv_heads, s, d).sum(2)


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-1, -2)) * scale
    if bias is not None:  # packed documents: 0 where the query sees the key, -inf elsewhere
        s = s + bias.to(s.dtype)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, bias=None) -> tuple:
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    s = _scores(q, k, causal, scale, bias)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype)), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, bias=None) -> tuple:
    kv_heads, acc = k.shape[1], _acc(q)
    k, v = expand_kv(k, q.shape[1]).to(acc), expand_kv(v, q.shape[1]).to(acc)
    dout = dout.to(acc)
    delta = (dout * out.to(acc)).sum(-1, keepdim=True)
    p = torch.exp(_scores(q, k, causal, scale, bias) - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq, reduce_kv(dk, kv_heads), reduce_kv(dv, kv_heads)


def _cuda_forward(kernel: str, q, k, v, causal: bool, scale: float) -> tuple:
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if kernel == "flash_cuda":
        r = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], r[1], (r[2], r[3], r[4], r[5], r[6], r[7])
    r = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return r[0], r[1][..., : q.shape[2]], (r[2], r[3])


def _cuda_backward(kernel: str, aux: tuple, dout, q, k, v, out, lse, causal: bool, scale: float) -> tuple:
    kv_heads = k.shape[1]
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if kernel == "flash_cuda":
        cq, ck, mq, mk, seed, offset = aux
        g = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
        )
    else:
        seed, offset = aux
        bias = torch.empty(0, device=q.device)
        g = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
    return g[0], reduce_kv(g[1], kv_heads), reduce_kv(g[2], kv_heads)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: str = "math",
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Attention of q (b, h, sq, d) over k, v (b, h_kv, sk, d) on ``kernel`` (``pick_kernel``):
    output and lse in the accumulation dtype (fp32, fp64 for fp64 inputs), and what the
    kernel's backward needs besides (None for math and CPU). ``bias`` (b, 1, sq, sk; 0 or -inf,
    in q's dtype): a mask (packed documents); the CPU flash op takes it, on CUDA it runs on math.
    A query that sees no key gets lse -inf (math) or 0 with a zero output (CPU flash)."""
    acc = _acc(q)
    if kernel == "flash_cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out.to(acc), lse.to(acc), None
    if kernel in ("flash_cuda", "efficient_cuda") and bias is None:
        try:
            out, lse, aux = _cuda_forward(kernel, q, k, v, causal, scale)
            return out.to(acc), lse.to(acc), aux
        except RuntimeError:  # a shape or layout the kernel refuses: the math below
            pass
    out, lse = _math_forward(q, k, v, causal, scale, bias)
    return out, lse, None


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: str = "math",
    aux: Any = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (b, h, sq, d), dk, dv (b, h_kv, sk, d) of one block, given the ring's merged output
    ``out`` and log-sum-exp ``lse`` for these queries (``bias``: the forward's mask)."""
    if kernel == "flash_cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(_acc(q)).contiguous(), 0.0, causal),
            attn_mask=bias,
            scale=scale,
        )
    if kernel in ("flash_cuda", "efficient_cuda") and aux is not None and bias is None:
        try:
            return _cuda_backward(kernel, aux, dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float(), causal, scale)
        except RuntimeError:
            pass
    return _math_backward(dout, q, k, v, out, lse, causal, scale, bias)
