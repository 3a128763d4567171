"""Element-wise passes of the eager Llama block (issue 37: eager spent 42% of its GPU kernel time
in element-wise kernels). RoPE rotates with one flip of the halves and a signed sin table (no
neg, no cat, no slice gradients, no cast pass); RMSNorm is one ``F.rms_norm`` call when weight
and input share a dtype (a fused kernel pair on CUDA). Counted on CPU with a dispatch mode, and
checked bit for bit against the previous formulas (kept in bench/bench_eager_passes.py, which
times the two side by side)."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.models import llama
from meshforge.models.llama import RMSNorm, apply_rope, build_model, rope_cos_sin, rope_inv_freq
from meshforge.models.shape import ModelShape

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_eager_passes import previous_cos_sin, previous_rms_norm, previous_rope  # noqa: E402

SHAPE = ModelShape(64, 2, 4, 2, 128, 256, 64)
VIEWS = {"view", "_unsafe_view", "t", "transpose", "detach", "expand", "slice", "unsqueeze", "alias", "as_strided"}


class Ops(TorchDispatchMode):
    """aten ops by name (overload dropped), views left out: each one left is a kernel."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def q_like(dtype, requires_grad=True):
    """A (batch, heads, seq, head_dim) view of a projection's output, as Attention makes it."""
    w = torch.randn(2, 24, 64, dtype=dtype).requires_grad_(requires_grad)
    return w, w.view(2, 24, 4, 16).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_rotate_half_formula_bit_for_bit(dtype):
    inv = rope_inv_freq(SHAPE)
    pos = torch.arange(5, 29)
    w, q = q_like(dtype)
    g = torch.randn(2, 4, 24, 16, dtype=dtype)
    apply_rope(q, *rope_cos_sin(inv, pos)).backward(g)
    new_out, new_grad = apply_rope(q, *rope_cos_sin(inv, pos)).detach(), w.grad
    w2, q2 = q_like(dtype)
    w2.data.copy_(w.data)
    ref = previous_rope(q2, *previous_cos_sin(inv, pos))
    ref.backward(g)
    assert torch.equal(new_out, ref.detach()) and torch.equal(new_grad, w2.grad)


def test_rope_pass_count():
    """Forward: one flip of the halves, two products (x read in bf16, computed in the fp32
    tables' dtype), a sum, a cast back. Backward: the gradient to fp32, the two products'
    gradients, each cast to bf16, the flip back and the sum of the two: 12 kernels, no clone
    (q's gradient keeps the projection's layout). The previous formula ran 18: neg, cat, six
    casts, slice gradients and one more add."""
    inv = rope_inv_freq(SHAPE)
    cos, sin = rope_cos_sin(inv, torch.arange(24))
    _, q = q_like(torch.bfloat16)
    g = torch.randn(2, 24, 4, 16, dtype=torch.bfloat16).transpose(1, 2)  # SDPA's gradient: q's layout
    ops = Ops()
    with ops:
        apply_rope(q, cos, sin).backward(g)
    expected = Counter({"flip": 2, "mul": 4, "add": 2, "_to_copy": 4})
    assert ops.count == expected


class Calls(TorchFunctionMode):
    """The torch functions and tensor methods a forward calls (outermost only)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((getattr(func, "__name__", str(func)), args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_one_call_when_weight_and_input_share_a_dtype(dtype):
    """One ``F.rms_norm`` with the weight: what CUDA runs as one fused kernel (and one in
    backward); the previous form was five calls (x.float(), rms_norm, weight.float(), mul, .to)."""
    norm = RMSNorm(64, 1e-5).to(dtype)
    x = torch.randn(3, 7, 64, dtype=dtype)
    mode = Calls()
    with mode:
        norm(x)
    [(name, args, kwargs)] = [c for c in mode.calls if c[0] not in ("__get__", "dtype")]
    assert name == "rms_norm" and (args[2] if len(args) > 2 else kwargs.get("weight")) is norm.weight


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_rms_norm_equals_the_fp32_formula_bit_for_bit(x_dtype, w_dtype):
    """Same dtypes: the one call computes in fp32 and rounds once, as the formula does; mixed
    (autocast's bf16 q and k before an fp32 QK-norm weight) keeps the formula itself."""
    norm = RMSNorm(64, 1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 64, dtype=x_dtype, requires_grad=True)
    g = torch.randn(3, 7, 64, dtype=x_dtype)
    out = norm(x)
    out.backward(g)
    got = (out.detach(), x.grad, norm.weight.grad)
    x.grad, norm.weight.grad = None, None
    ref = previous_rms_norm(norm, x)
    ref.backward(g)
    assert out.dtype == x_dtype and all(
        torch.equal(a, b) for a, b in zip(got, (ref.detach(), x.grad, norm.weight.grad), strict=True)
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights"])
def test_model_loss_and_gradients_equal_the_previous_formulas(precision, monkeypatch):
    """The whole model, forward and backward, against the previous RoPE and RMSNorm: losses and
    every gradient bit-identical on CPU, in fp32, under bf16 autocast (meshforge's CPU bf16) and
    with bf16 weights (FSDP2's cast-once policy, CUDA's default)."""
    x, y = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))

    def run():
        torch.manual_seed(0)
        model = build_model(SHAPE, seed=3)
        model = model.to(torch.bfloat16) if precision == "bf16-weights" else model
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = run()
    monkeypatch.setattr(llama, "rope_cos_sin", previous_cos_sin)
    monkeypatch.setattr(llama, "apply_rope", previous_rope)
    monkeypatch.setattr(llama.RMSNorm, "forward", previous_rms_norm)
    ref_loss, ref_grads = run()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_block_has_no_rotate_half_round_trips_or_weight_casts():
    """One eager forward + backward of a dense block with bf16 weights (cast-once): no neg, cat,
    slice gradients or layout copies from RoPE, and the norms cast no weight."""
    model = build_model(SHAPE).to(torch.bfloat16)
    cos, sin = rope_cos_sin(model.rope_inv_freq, torch.arange(16))
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    casts = []

    class Casts(Ops):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy":
                casts.append(tuple(args[0].shape))
            return super().__torch_dispatch__(func, types, args, kwargs)

    ops = Casts()
    with ops:
        out = model.layers["0"](x, cos, sin)
    forward_casts = list(casts)
    with ops:
        out.float().sum().backward()
    assert not {"neg", "cat", "slice_backward", "clone"} & set(ops.count)
    assert (64,) not in forward_casts  # no weight.float() in forward


@pytest.mark.slow
def test_dense_bf16_block_is_still_one_graph():
    """The dtype branch in RMSNorm and the flip compile into the block's one graph."""
    model = build_model(SHAPE).to(torch.bfloat16)
    cos, sin = rope_cos_sin(model.rope_inv_freq, torch.arange(16))
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    dynamo.reset()
    e = dynamo.explain(model.layers["0"])(x, cos, sin)
    assert (e.graph_count, e.graph_break_count) == (1, 0)


def cuda_kernels(fn) -> int:
    """GPU kernels one call of ``fn`` launches (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: lazy init and caching allocator out of the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.cuda
def test_cuda_rms_norm_and_rope_launch_fewer_kernels():
    """On CUDA the one F.rms_norm call is the fused kernel pair, and RoPE launches what the CPU
    count says: both fewer kernels than the previous formulas, forward + backward, in bf16."""
    dev = torch.device("cuda")
    norm = RMSNorm(2048, 1e-5).to(dev, torch.bfloat16)
    x = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    new = cuda_kernels(lambda: norm(x).backward(g))
    old = cuda_kernels(lambda: previous_rms_norm(norm, x).backward(g))
    assert new < old and cuda_kernels(lambda: norm(x.detach())) <= 2, (new, old)
    inv = rope_inv_freq(ModelShape(2048, 1, 32, 8, 8192, 256, 4096)).to(dev)
    w = torch.randn(2, 4096, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    q = w.view(2, 4096, 32, 64).transpose(1, 2)
    gq = torch.randn(2, 4096, 32, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    pos = torch.arange(4096, device=dev)
    new = cuda_kernels(lambda: apply_rope(q, *rope_cos_sin(inv, pos)).backward(gq))
    old = cuda_kernels(lambda: previous_rope(q, *previous_cos_sin(inv, pos)).backward(gq))
    assert new < old, (new, old)


@pytest.mark.cuda
def test_cuda_bf16_model_matches_the_previous_formulas(monkeypatch):
    """bf16 weights on CUDA (cast-once): loss and gradients within bf16 rounding of the previous
    formulas (the fused norm rounds once as they did, in its own order)."""
    x, y = torch.randint(0, 256, (2, 64), device="cuda"), torch.randint(0, 256, (2, 64), device="cuda")

    def run():
        model = build_model(SHAPE, device="cuda", seed=3).to(torch.bfloat16)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    loss, grads = run()
    monkeypatch.setattr(llama, "rope_cos_sin", previous_cos_sin)
    monkeypatch.setattr(llama, "apply_rope", previous_rope)
    monkeypatch.setattr(llama.RMSNorm, "forward", previous_rms_norm)
    ref_loss, ref_grads = run()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for n, ref in ref_grads.items():
        torch.testing.assert_close(grads[n], ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()), msg=n)
