"""The chunked head + cross-entropy (models/chunked_loss.py) against the plain fp32 loss:
values and gradients to 1e-6 (ignore_index, tied weights, ragged last chunk), the one loss
object's seam with the model, the config key, compile without graph breaks, and measured
peak memory (<= 1/4 of the plain path's at vocab 128256 x seq 4096)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from conftest import assert_as_exact_as
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models.chunked_loss import IGNORE_INDEX, chunked_cross_entropy
from meshforge.models.llama import build_model
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.shape import ModelShape


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale (gradient entries near 0 have no relative error)."""
    return float((a - b).abs().max() / b.abs().max())


def inputs(n: int = 75, h: int = 16, v: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, h, generator=g).requires_grad_()
    w = torch.randn(v, h, generator=g).requires_grad_()
    t = torch.randint(0, v, (3, n), generator=g)
    t[0, :5] = IGNORE_INDEX  # padding
    t[2, -1] = IGNORE_INDEX
    return x, w, t


@pytest.mark.parametrize("chunk", [1, 16, 64, 10_000])  # 225 tokens: ragged last chunk, and one chunk
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equals_cross_entropy_fp32(chunk, reduction):
    x, w, t = inputs()
    got = chunked_cross_entropy(x, w, t, chunk, reduction)
    gx, gw = torch.autograd.grad(got, (x, w))
    ref = F.cross_entropy((x @ w.T).float().flatten(0, 1), t.flatten(), reduction=reduction)
    rx, rw = torch.autograd.grad(ref, (x, w))
    # chunks sum the tokens' losses (and the head's gradient) in another order than one call:
    # both fp32 paths are held to the exact result, the chunks within a few times the plain one's error
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = F.cross_entropy((x64 @ w64.T).flatten(0, 1), t.flatten(), reduction=reduction)
    ex, ew = torch.autograd.grad(exact, (x64, w64))
    assert_as_exact_as(got.detach(), ref.detach(), exact.detach(), msg="loss")
    assert_as_exact_as(gx, rx, ex, msg="grad x")
    assert_as_exact_as(gw, rw, ew, msg="grad w")
    assert float(gx[0, :5].abs().max()) == 0.0  # ignored tokens give no gradient


def test_upstream_gradient_scales_and_no_grad_gives_the_value():
    x, w, t = inputs()
    got = chunked_cross_entropy(x, w, t, 32)
    (3.0 * got).backward()
    ref = F.cross_entropy((x.detach() @ w.detach().T).flatten(0, 1), t.flatten())
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = F.cross_entropy((x64 @ w64.T).flatten(0, 1), t.flatten())
    (3.0 * exact).backward()
    with torch.no_grad():
        assert_as_exact_as(chunked_cross_entropy(x, w, t, 32), ref, exact.detach(), msg="no-grad loss")
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (3.0 * F.cross_entropy((x2 @ w2.T).flatten(0, 1), t.flatten())).backward()
    assert_as_exact_as(x.grad, x2.grad, x64.grad, msg="grad x")
    assert_as_exact_as(w.grad, w2.grad, w64.grad, msg="grad w")


def tiny_model(tied: bool):
    args = ModelShape(
        hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=101, max_seq_len=64, tie_embeddings=tied
    )
    return build_model(args, seed=3)


@pytest.mark.parametrize("tied", [False, True])
def test_loss_object_seam_matches_plain_model(tied):
    """The one loss object with a chunk size, over the model's hidden states (hidden_out),
    gives the plain loss over its logits, and the same gradient for every parameter (a
    tied head's shows both uses), in training and evaluation."""
    plain = tiny_model(tied)
    chunked = copy.deepcopy(plain)
    chunked.tie_weights()
    chunked.hidden_out = True
    tokens = torch.randint(0, 101, (2, 23))
    targets = torch.randint(0, 101, (2, 23))
    exact_model = copy.deepcopy(plain).double()  # the exact result both fp32 paths are held to
    ref = LanguageModelLoss()(plain(tokens), targets, plain)
    got = LanguageModelLoss(loss_chunk_size=10)(chunked(tokens), targets, chunked)
    exact = LanguageModelLoss()(exact_model(tokens), targets, exact_model)
    for loss in (ref, got, exact):
        loss.backward()
    assert_as_exact_as(got.detach(), ref.detach(), exact.detach(), msg="loss")
    assert (chunked.output.weight is chunked.tok_embeddings.weight) == tied
    params = zip(plain.named_parameters(), chunked.parameters(), exact_model.parameters(), strict=True)
    for (name, p), q, e in params:
        assert_as_exact_as(q.grad, p.grad, e.grad, msg=name)
    with torch.no_grad():
        s_ref = LanguageModelLoss().token_sum(plain(tokens), targets, plain)
        s_got = LanguageModelLoss(loss_chunk_size=7).token_sum(chunked(tokens), targets, chunked)
        s_exact = LanguageModelLoss().token_sum(exact_model(tokens), targets, exact_model)
    assert_as_exact_as(s_got, s_ref, s_exact, msg="token sum")


def test_mismatched_model_and_loss_are_refused():
    model = tiny_model(False)
    tokens = torch.randint(0, 101, (1, 8))
    with pytest.raises(ValueError, match="chunked loss"):
        LanguageModelLoss(loss_chunk_size=4)(model(tokens), tokens, model)  # logits, not hidden states
    model.hidden_out = True
    with pytest.raises(ValueError, match="hidden_out"):
        LanguageModelLoss()(model(tokens), tokens, model)


def test_config_key_is_validated():
    assert load_config(None, {}).train.loss_chunk_size > 0  # on by default: long sequences are safe
    with pytest.raises(ConfigError, match=r"train.loss_chunk_size = -1 is out of range: it must be in \[0, "):
        load_config(None, {"train.loss_chunk_size": -1})
    with pytest.raises(ConfigError, match="train.fp8_exclude"):
        load_config(None, {"train.precision": "fp8", "train.fp8_exclude": ["*router*"]})
    fp8 = {"train.precision": "fp8", "train.fp8_exclude": ["*router*"], "train.loss_chunk_size": 0}
    assert load_config(None, fp8).train.loss_chunk_size == 0


def test_compiled_loss_keeps_no_logits_for_backward():
    """Under torch.compile the chunk loop stays outside the graph (one deliberate break) and each
    chunk's math compiles on its own: the loss equals the reference and what it keeps for backward
    is the Function's own (the hidden states' and the head's gradients), nothing of tokens x vocab.
    Traced whole, the partitioner chose by size between those and every chunk's bf16 logits
    gradient (2 bytes per vocabulary entry and token), so what the loss held depended on the shape."""
    from meshforge.calibration.saved_activations import measure

    torch._dynamo.reset()
    tokens, vocab, hidden = 96, 512, 64  # fewer tokens than 2 x hidden: keeping the chunks' gradients is smaller
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.1).requires_grad_()
    t = torch.randint(0, vocab, (1, tokens))
    fn = torch.compile(lambda a, b, c: chunked_cross_entropy(a, b, c, 16, compute_dtype=torch.bfloat16, fused=True))
    got = measure(lambda: fn(x, w, t), [w], eager=False)
    assert sorted(row[1] for row in got.table() if row[1]) == [(tokens, hidden), (vocab, hidden)], got.table()
    explained = torch._dynamo.explain(fn._torchdynamo_orig_callable)(x, w, t)
    assert explained.graph_break_count == 1 and "disable" in str(explained.break_reasons[0].reason)
    loss = fn(x, w, t)
    ref = F.cross_entropy((x.bfloat16() @ w.bfloat16().T).float().flatten(0, 1), t.flatten())
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-3)
    loss.backward()
    assert x.grad is not None and w.grad is not None


def plain_loss(x, w, t, chunk):
    return F.cross_entropy((x @ w.T).float().flatten(0, 1), t.flatten())


def chunked_loss(x, w, t, chunk):
    return chunked_cross_entropy(x, w, t, chunk)


def peak_bytes(loss_fn, vocab: int, seq: int, chunk: int, fake: bool) -> int:
    """Peak bytes of the tensors alive during forward + backward of ``loss_fn`` (torch's
    MemTracker: every storage an op allocates, until it is freed), the inputs excluded.
    ``fake``: on fake tensors (no data: the same allocations, none of the compute)."""
    mode = FakeTensorMode() if fake else torch.device("cpu")
    with mode:
        x = torch.randn(1, seq, 64).requires_grad_()
        w = (torch.randn(vocab, 64) * 0.02).requires_grad_()
        t = torch.randint(0, vocab, (1, seq))
        tracker = MemTracker()
        with tracker:
            loss_fn(x, w, t, chunk).backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("loss_fn, can_pass", [(chunked_loss, True), (plain_loss, False)])
def test_peak_memory_is_at_most_a_quarter_of_plain(loss_fn, can_pass):
    """vocab 128256 x seq 4096, hidden 64: the plain path's peak is ~3 copies of the 2.1 GB
    fp32 logits; the chunked one (1024 tokens) holds one chunk's. The check fails for the
    plain path (its own ratio is 1), so it can fail. Fake tensors: the allocations without
    6 GB of real memory on a shared CI machine (test_fake_peak_equals_real checks they agree)."""
    plain = peak_bytes(plain_loss, 128256, 4096, 1024, fake=True)
    got = peak_bytes(loss_fn, 128256, 4096, 1024, fake=True)
    assert plain > 3 * 4096 * 128256 * 4 * 0.9  # logits, log-softmax, their gradient
    assert (got <= plain / 4) == can_pass, f"peak ratio {got / plain:.3f}"


@pytest.mark.slow
def test_fake_peak_equals_real():
    """The fake-tensor measurement is the real one: same peaks on real CPU tensors (smaller size)."""
    real = {fn: peak_bytes(fn, 128256, 1024, 256, fake=False) for fn in (plain_loss, chunked_loss)}
    for fn, got in real.items():
        assert peak_bytes(fn, 128256, 1024, 256, fake=True) == pytest.approx(got, rel=0.02)
    assert real[chunked_loss] <= real[plain_loss] / 4


def test_planner_counts_one_chunk_of_logits():
    """planner/memory.py's memory(): with the whole logits a 1B run at 32K peaks in its loss's
    backward (14 bytes a logit: the logits the step holds, the fp32 log-softmax, its gradient and
    the logits' fp32 gradient); the chunked loss's own working set is one chunk's logits."""
    from meshforge.planner import peak_bytes
    from meshforge.planner.estimate import plan_layout
    from meshforge.planner.hardware import get_hardware
    from meshforge.planner.memory import memory, step_tensors
    from meshforge.planner.model_flags import from_preset

    shape, hw = from_preset("llama3.2-1b"), get_hardware("h100-sxm")
    lay = plan_layout(activation_checkpoint="full")
    plain = memory(shape, lay, 32768, "bf16", hw, loss_chunk_size=0)["working"]
    chunked = memory(shape, lay, 32768, "bf16", hw, loss_chunk_size=1024)["working"]
    per_logit = 2 + 4 + 4 + 4  # bf16 logits; fp32 log-softmax, its gradient, the logits' fp32 gradient
    assert plain * 2**30 == pytest.approx(32768 * shape.vocab_size * per_logit)
    t = step_tensors(shape, lay, 32768, "bf16", True, 1024, "cast_once", False)
    assert t.loss_working == peak_bytes.chunk_working(32768, shape.vocab_size, shape.hidden, 1024, 2)
    assert t.loss_working == 1024 * (6 * shape.vocab_size + 2 * shape.hidden)  # one chunk's rows
    assert plain - chunked > 35  # GiB: where 1B at 32K ran out of memory


def test_bf16_compute_matches_autocast_plain_path():
    """compute_dtype bf16 (runs that autocast): the same bf16 logits as autocast's head, so the
    same loss; gradients to bf16 precision (the head weight's is accumulated in fp32 here)."""
    x, w, t = inputs(n=50, h=32, v=300)
    got = chunked_cross_entropy(x, w, t, 16, compute_dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad(got, (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = x @ w.T
    ref = F.cross_entropy(logits.float().flatten(0, 1), t.flatten())
    rx, rw = torch.autograd.grad(ref, (x, w))
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert gx.dtype == gw.dtype == torch.float32
    assert rel_err(gx, rx) < 2e-2 and rel_err(gw, rw) < 2e-2
