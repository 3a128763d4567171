"""Packed documents on every axis: whole runs on a corpus of short documents (several per
sequence, so the mask and the reset positions matter) under tp 2, pp 2, cp 2 (both splits, ring
and all-gather rotation), cp 2 x tp 2 and dp 2 x cp 2 reproduce the single-process run (fp32,
gloo, CPU): the first step's loss and gradient norm to 1e-6, the whole run as every layout test
does. The single-process run equals its documents trained one by one (test_packed_documents.py).
Ring attention over documents against the dense mask, per rank, for both cp degrees, splits,
rotations and kernels; a corpus without separators warns once."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import assert_run_matches, layout_runner, rendezvous, tiny_config, train
from meshforge.models.document_attention import dense_mask
from meshforge.models.documents import Documents
from meshforge.parallel.context.kernels import KERNELS
from meshforge.parallel.context.ring import RingAttention, shard_index

STEPS = 3
COMMON = {
    "train.steps": STEPS,
    "train.seq_len": 64,
    "train.global_batch_size": 4,
    "train.micro_batch_size": 2,
    "train.grad_clip": 0.5,
    "train.eval_batches": 1,
    "optim.lr": 1e-3,
    "data.val_fraction": 0.05,  # (a small corpus: enough for one global batch of validation)
}
LAYOUTS = {  # name: (ranks, overrides)
    "tp2": (2, {"parallel.tp": 2}),
    "pp2": (2, {"parallel.pp": 2}),  # two micro-batches: each stage takes its micro-batch's documents
    "cp2-zigzag-ring": (2, {"parallel.cp": 2}),
    "cp2-none-allgather": (2, {"parallel.cp": 2, "parallel.cp_balance": "none", "parallel.cp_rotate": "allgather"}),
    "cp2-tp2": (4, {"parallel.cp": 2, "parallel.tp": 2}),
    "dp2-cp2": (4, {"parallel.cp": 2, "parallel.dp_shard": 2}),
}


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A JSONL corpus of 1500 short documents (3 to 60 characters): about 2 to 4 per sequence of 64."""
    d = tmp_path_factory.mktemp("short-docs")
    words = "the of packed document attention ring block mask causal token sequence boundary".split()
    lines = []
    for i in range(1500):
        n = 1 + (i * 7919) % 9
        lines.append(json.dumps({"text": " ".join(words[(i + j * 3) % len(words)] for j in range(n))}))
    (d / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def reference(tmp_path_factory, short_docs):
    d = tmp_path_factory.mktemp("ref") / "run"
    train(tiny_config(d, short_docs, **COMMON))
    return d


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, short_docs):
    return layout_runner(tmp_path_factory, short_docs, LAYOUTS, COMMON)


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_layout_matches_single_process(name, reference, layout_runs):
    run = layout_runs(name)
    ref, got = _metrics(reference)[0], _metrics(run)[0]
    assert ref["attention_span"] < 0.6 * COMMON["train.seq_len"]  # the mask removed work: documents are short
    # every step's loss and gradient norm, step 1 included, to 1e-5 (assert_run_matches): a mean
    # of 256 positive per-token losses summed in another order is only bounded by 256 ulp
    # (conftest.reorder_bound), so a tighter step-1 check would hold on one CPU's order only
    assert got["attention_span"] == pytest.approx(ref["attention_span"], rel=1e-12)
    assert_run_matches(reference, run, STEPS)


MOE = {"model.preset": "debug-moe", "model.hidden": 64, "model.heads": 4, "model.kv_heads": 2, "model.layers": 2}
MOE |= {"model.moe_ffn_hidden": 64}


@pytest.mark.slow
def test_packed_documents_under_expert_parallelism(tmp_path_factory, short_docs):
    """ep 2 (each rank's tokens dispatched to the other's experts) with document masks and reset
    positions reproduces the single-process MoE run on the same short documents."""
    ref = tmp_path_factory.mktemp("moe-ref") / "run"
    train(tiny_config(ref, short_docs, **COMMON, **MOE))
    run = layout_runner(tmp_path_factory, short_docs, {"ep2": (2, {**MOE, "parallel.ep": 2})}, COMMON)("ep2")
    assert _metrics(ref)[0]["attention_span"] < 0.6 * COMMON["train.seq_len"]  # the documents are masked
    assert_run_matches(ref, run, STEPS)  # every step, step 1 included (see above)


@pytest.mark.slow
def test_masking_changes_the_run_and_activation_checkpointing_keeps_it(tmp_path, short_docs, reference):
    """Without the mask the same data trains to another loss (the mask is not a no-op here), and
    full recomputation (the documents captured for the recomputed forward) reproduces the run."""
    plain = tmp_path / "plain"
    train(tiny_config(plain, short_docs, **COMMON, **{"data.document_mask": False, "data.reset_positions": False}))
    assert _metrics(plain)[0]["loss"] != pytest.approx(_metrics(reference)[0]["loss"], rel=1e-4)
    assert "attention_span" not in _metrics(plain)[0]
    ac = tmp_path / "ac"
    train(tiny_config(ac, short_docs, **COMMON, **{"train.activation_checkpoint": "full"}))
    assert_run_matches(reference, ac, STEPS)


def test_corpus_without_separators_warns_once(tmp_path, corpus):
    """One file is one document: every sequence holds a single document, and the run says so once."""
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.py").write_text((corpus / "textwrap.py").read_text())
    run = tmp_path / "run"
    train(tiny_config(run, one, **{"train.steps": 2, "train.eval_batches": 0}))
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    warned = [e for e in events if e.get("event") == "warning" and e.get("key") == "data.document_mask"]
    assert len(warned) == 1
    assert "100% of" in warned[0]["message"] and "single document" in warned[0]["message"]
    quiet = tmp_path / "quiet"
    train(tiny_config(quiet, corpus, **{"train.steps": 1, "train.eval_batches": 0}))  # five files: separated
    assert "data.document_mask" not in (quiet / "events.jsonl").read_text()


LENGTHS = [[5, 3, 1, 11, 12], [32], [16, 16], [1] * 32]


def _ring_worker(rank: int, cp: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=cp)
    try:
        docs = Documents.from_lengths(LENGTHS, 32)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(4, 32, n, 8, generator=gen, dtype=torch.float64).transpose(1, 2) for n in (4, 2, 2))
        dout = torch.randn(4, 4, 32, 8, generator=gen, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, attn_mask=dense_mask(docs.ids, docs.ids), enable_gqa=True)
        ref.backward(dout)
        for balance, rotate in [("zigzag", "ring"), ("none", "allgather"), ("zigzag", "allgather"), ("none", "ring")]:
            idx = shard_index(32, cp, rank, balance)
            for kernel in KERNELS:
                local = [t.transpose(1, 2)[:, idx].transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
                core = RingAttention(dist.group.WORLD, rank, cp, balance, rotate, kernel)
                out = core(*local, documents=docs)
                out.backward(dout[:, :, idx])
                case = (cp, balance, rotate, kernel)
                torch.testing.assert_close(out, ref[:, :, idx].detach(), rtol=1e-6, atol=1e-6, msg=f"out {case}")
                for name, got, want in zip("qkv", local, full, strict=True):
                    torch.testing.assert_close(
                        got.grad, want.grad[:, :, idx], rtol=1e-6, atol=1e-6, msg=f"d{name} {case}"
                    )
                plan = core.plan(docs)
                if balance == "zigzag":  # every rank holds a later chunk: the one-token documents' row skips
                    assert plan.skipped > 0 and plan.computed > 0  # every block off the diagonal
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_over_documents_equals_the_dense_mask(cp):
    """Every rank's outputs and dq, dk, dv against SDPA with the dense document mask (fp64),
    for both splits and rotations and both kernels; fully masked blocks are skipped."""
    mp.spawn(_ring_worker, args=(cp, rendezvous()), nprocs=cp, join=True)
