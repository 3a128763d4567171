"""Packed documents (models/documents.py, models/document_attention.py, data/eos_boundaries.py):
one packed sequence with document masking and reset positions equals its documents trained one
by one (loss and gradients, fp32); a batch of single documents is bit for bit the causal path;
every attention path (CPU tiles, dense mask under compile, FlexAttention) equals the dense
reference; boundaries that do not describe the batch are refused by name."""

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F

from conftest import assert_as_exact_as
from meshforge.data.eos_boundaries import document_lengths
from meshforge.errors import DataError
from meshforge.models.document_attention import (
    TILE,
    attended_fraction,
    dense_mask,
    document_attention,
    prepare_block_mask,
)
from meshforge.models.documents import Documents
from meshforge.models.llama import build_model, rope_cos_sin
from meshforge.models.loss import LanguageModelLoss
from meshforge.models.shape import ModelShape

EOS = 255


def tiny(**kw):
    return build_model(ModelShape(64, 2, 4, 2, 128, 256, 512, **kw), device="cpu", seed=3)


def packed_row(lengths, seed=0):
    """Tokens (seq + 1) whose documents (each ending in EOS) have these lengths; the last may run on."""
    gen = np.random.default_rng(seed)
    row = np.concatenate([np.append(gen.integers(0, EOS, n - 1), EOS) for n in lengths])
    return torch.from_numpy(np.append(row, gen.integers(0, EOS)))


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("lengths", [[37, 1, 2, 90, 30], [5] * 32, [150, 10]], ids=["mixed", "many-short", "two"])
def test_packed_sequence_equals_its_documents_one_by_one(lengths):
    """The defining equivalence: loss and gradients of one packed sequence (masked, positions
    reset) are those of its documents trained alone, each on its own tokens and targets."""
    seq = sum(lengths)
    tokens = packed_row(lengths).unsqueeze(0)
    assert document_lengths(tokens[:, :-1].numpy(), EOS) == [lengths]  # what the sampler finds
    docs = Documents.from_lengths(document_lengths(tokens[:, :-1].numpy(), EOS), seq)
    loss = LanguageModelLoss()
    model = tiny()
    packed = loss.token_sum(model(tokens[:, :-1], docs.positions, docs), tokens[:, 1:], model) / seq
    packed.backward()
    got = grads(model)
    model.zero_grad(set_to_none=True)
    total, start = torch.zeros(()), 0
    for n in lengths:  # each document alone: positions from 0, no mask needed
        x, y = tokens[:, start : start + n], tokens[:, start + 1 : start + n + 1]
        total = total + loss.token_sum(model(x), y, model)
        start += n
    (total / seq).backward()
    torch.testing.assert_close(packed, total / seq, rtol=1e-6, atol=1e-6)
    for g, want in zip(got, grads(model), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)


def test_one_document_per_row_is_bit_for_bit_the_causal_path():
    """Every document as long as the sequence: the masked run is today's, to the bit."""
    tokens = torch.randint(0, EOS, (3, 65))  # no separator inside any row
    docs = Documents.from_lengths(document_lengths(tokens[:, :-1].numpy(), EOS), 64)
    assert docs.single
    runs = []
    for masked in (False, True):
        model = tiny()
        out = model(tokens[:, :-1], docs.positions if masked else None, docs if masked else None)
        LanguageModelLoss()(out, tokens[:, 1:], model).backward()
        runs.append((out, grads(model)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def random_documents(rows, seq, mean, seed):
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        lens, left = [], seq
        while left:
            n = int(min(left, max(1, gen.exponential(mean))))
            lens.append(n)
            left -= n
        out.append(lens)
    return out


@pytest.mark.parametrize(("seq", "mean", "kv"), [(3 * TILE + 40, 60, 2), (8 * TILE, 60, 4), (TILE // 2, 20, 1)])
def test_cpu_tiles_equal_the_dense_mask(seq, mean, kv):
    """The CPU path (query tiles, first keys at the earliest document start) against SDPA with
    the dense mask: outputs and input gradients, GQA included; it skips work where documents end."""
    docs = Documents.from_lengths(random_documents(3, seq, mean, seed=seq), seq)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, n, seq, 16, generator=gen, requires_grad=True) for n in (4, kv, kv))
    dout = torch.randn(3, 4, seq, 16, generator=gen)
    mask = dense_mask(docs.ids, docs.ids)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv != 4)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=kv != 4)
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), dout.double())
    out = document_attention(q, k, v, docs)
    got = torch.autograd.grad(out, (q, k, v), dout)
    # tiles sum keys (and dk, dv over query tiles) in another order than one dense SDPA: both are
    # held to the exact result, the tiles within a few times the dense path's own round-off
    assert_as_exact_as(out, ref, exact, msg="output")
    for name, g, w, e in zip("qkv", got, want, exact_grads, strict=True):
        assert_as_exact_as(g, w, e, msg=f"d{name}")
    if seq == 8 * TILE:
        assert attended_fraction(docs) < 0.6  # whole documents before a tile are not computed


def test_compiled_block_takes_documents_in_one_graph_without_recompiling():
    """Under torch.compile the core uses the dense mask built in the graph from the ids: one graph,
    no break, the eager (tiled) values, and a new batch's documents reuse the graph."""
    model = tiny()
    block = model.layers["0"]
    x = torch.randn(2, 96, 64)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    dynamo.reset()
    dynamo.utils.counters.clear()  # (reset keeps the counters: graphs compiled by earlier tests count)
    for seed in (0, 1):
        docs = Documents.from_lengths(random_documents(2, 96, 20, seed), 96)
        cos, sin = rope_cos_sin(model.rope_inv_freq, docs.positions.reshape(-1))
        cos, sin = (t.view(2, 1, 96, -1) for t in (cos, sin))
        torch.testing.assert_close(compiled(x, cos, sin, documents=docs), block(x, cos, sin, documents=docs))
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1
    e = dynamo.explain(block)(x, cos, sin, documents=docs)
    assert (e.graph_count, e.graph_break_count) == (1, 0)


@pytest.mark.slow
def test_flex_attention_path_equals_the_dense_mask():
    """The CUDA path's block mask and FlexAttention call, run here on the CPU (forward only: flex
    has no CPU backward), against the dense reference."""
    seq = 256
    docs = Documents.from_lengths(random_documents(2, seq, 40, seed=5), seq)
    prepare_block_mask(docs, torch.device("cpu"), flex=True)
    assert docs.block_mask is not None
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, seq, 16, generator=gen) for n in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(docs.ids, docs.ids), enable_gqa=True)
    torch.testing.assert_close(document_attention(q, k, v, docs), ref, rtol=1e-5, atol=1e-5)


def test_document_lengths_from_separators():
    rows = np.array([[1, EOS, 2, 3, EOS, EOS, 4, 5], [1, 2, 3, 4, 5, 6, 7, EOS], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    assert document_lengths(rows, EOS) == [[2, 3, 1, 2], [8], [1, 7]]


def test_boundaries_that_do_not_describe_the_batch_are_refused_by_name():
    with pytest.raises(DataError, match=r"row 1 .*summing to 30.*train\.seq_len = 32"):
        Documents.from_lengths([[32], [10, 20]], 32)
    with pytest.raises(DataError, match=r"row 0 .*smallest 0"):
        Documents.from_lengths([[0, 32]], 32)
    docs = Documents.from_lengths([[16, 16], [32]], 32)
    with pytest.raises(DataError, match="given for 2 sequences, but the batch holds 3"):
        tiny()(torch.zeros(3, 32, dtype=torch.long), docs.positions, docs)


def test_positions_restart_and_span_counts_the_masked_work():
    docs = Documents.from_lengths([[3, 5], [8]], 8)
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]
    assert docs.ids.tolist()[0] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert docs.span() == pytest.approx(((9 + 25) / 8 + 64 / 8) / 2)
    assert docs.rows(1, 2).lengths == ((8,),) and docs.rows(1, 2).single
