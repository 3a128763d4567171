"""The block kernels ring attention runs on: the fused ops PyTorch has for the device agree
with the fp32 math fallback (outputs, log-sum-exp, and the gradients given a merged lse),
and a missing op falls back to math."""

import math

import pytest
import torch

from meshforge.parallel.context import kernels as ak

CASES = [  # (heads, kv_heads, q_len, k_len, head_dim, causal)
    (4, 2, 8, 8, 8, True),
    (4, 4, 5, 7, 5, False),
    (6, 2, 12, 12, 3, True),
    (2, 1, 1, 9, 16, False),
]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(h, hkv, sq, sk, d, dtype, device):
    gen = torch.Generator().manual_seed(h * 1000 + sq * 10 + d)
    q = torch.randn(2, sq, h, d, generator=gen).transpose(1, 2)  # non-contiguous, as the model gives them
    k, v = (torch.randn(2, hkv, sk, d, generator=gen) for _ in range(2))
    dout = torch.randn(2, h, sq, d, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_matches_math(case, dtype, device):
    h, hkv, sq, sk, d, causal = case
    q, k, v, dout = _inputs(h, hkv, sq, sk, d, dtype, device)
    kernel = ak.pick_kernel(q)
    if device == "cpu":
        assert kernel == "flash_cpu"  # the installed torch has the CPU op: the test must exercise it
    scale = 1 / math.sqrt(d)
    tol = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2}[dtype]
    want_out, want_lse, _ = ak.block_forward(q, k, v, causal, scale, "math")
    got_out, got_lse, aux = ak.block_forward(q, k, v, causal, scale, kernel)
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, want_lse, rtol=tol, atol=tol)
    assert got_out.dtype == want_out.dtype == torch.promote_types(dtype, torch.float32)
    # the backward of a block that is part of a longer ring: a merged lse larger than the block's own
    lse = want_lse + 0.25
    out = want_out * math.exp(-0.25)
    want = ak.block_backward(dout, q, k, v, out, lse, causal, scale, "math")
    got = ak.block_backward(dout, q, k, v, out, lse, causal, scale, kernel, aux)
    for name, g, w, t in zip("qkv", got, want, (q, k, v), strict=True):
        assert g.shape == t.shape, name
        torch.testing.assert_close(g.to(w.dtype), w, rtol=tol, atol=tol, msg=f"d{name}")


def test_math_block_matches_sdpa():
    """The fallback itself against PyTorch's SDPA (autograd for the gradients)."""
    q, k, v, dout = _inputs(4, 2, 8, 8, 8, torch.float64, "cpu")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    out, lse, _ = ak.block_forward(q, k, v, True, 1 / math.sqrt(8), "math")
    torch.testing.assert_close(out, ref.detach())
    grads = ak.block_backward(dout, q, k, v, out, lse, True, 1 / math.sqrt(8), "math")
    for g, t in zip(grads, full, strict=True):
        torch.testing.assert_close(g, t.grad)


def test_missing_op_falls_back_to_math(monkeypatch):
    q = torch.randn(1, 2, 4, 8)
    assert ak.pick_kernel(q, "math") == "math"
    monkeypatch.setattr(ak, "_has", lambda name: False)
    assert ak.pick_kernel(q) == "math"
    assert ak.pick_kernel(q.to(torch.int64)) == "math"
