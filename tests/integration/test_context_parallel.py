"""Context parallelism: ring attention is exact attention (outputs and input gradients against
full causal SDPA, in real gloo process groups), and whole runs under cp reproduce the
single-process run (fp32, gloo, CPU) like the other axes do."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import assert_run_matches, layout_runner, rendezvous, tiny_config, tiny_overrides, train
from meshforge.checkpoint.weights import load_weights
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.models.flops import num_params
from meshforge.parallel.context.kernels import KERNELS
from meshforge.parallel.context.ring import RingAttention, shard_index
from meshforge.planner.context_costs import local_tokens, ring_bytes, ring_saved_bytes_per_token
from meshforge.resolve import resolve

CASES = [  # (cp, balance, rotate, heads, kv_heads, head_dim, seq_len)
    (2, "zigzag", "ring", 4, 2, 8, 16),
    (2, "none", "allgather", 4, 4, 5, 12),
    (4, "zigzag", "allgather", 4, 1, 7, 16),
    (4, "none", "ring", 2, 2, 8, 16),
    (4, "zigzag", "ring", 6, 2, 3, 24),
    (2, "none", "ring", 4, 2, 9, 8),
]


def _worker(rank: int, cp: int, store: str, cases: list) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=cp)
    try:
        for _, balance, rotate, h, hkv, d, seq in cases:
            gen = torch.Generator().manual_seed(seq * 100 + h * 10 + d)
            # (batch, seq, heads, dim) transposed, as the model's projections give them: non-contiguous views
            q, k, v = (
                torch.randn(2, seq, n, d, generator=gen, dtype=torch.float64).transpose(1, 2) for n in (h, hkv, hkv)
            )
            dout = torch.randn(2, h, seq, d, generator=gen, dtype=torch.float64)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=h != hkv)
            ref.backward(dout)
            idx = shard_index(seq, cp, rank, balance)
            for kernel in KERNELS:  # the fused CPU op and the math fallback
                local = [
                    t[:, idx].transpose(1, 2).requires_grad_()
                    for t in (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                ]
                case = (cp, balance, rotate, h, hkv, d, kernel)
                saved = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t, _s=saved: _s.append(t) or t, lambda t: t):
                    out = RingAttention(dist.group.WORLD, rank, cp, balance, rotate, kernel)(*local)
                kept = sum(t.numel() * t.element_size() for t in saved)
                assert kept == 2 * len(idx) * ring_saved_bytes_per_token(h, hkv, d, 8), (kept, case)
                out.backward(dout[:, :, idx])
                torch.testing.assert_close(out, ref[:, :, idx].detach(), rtol=1e-6, atol=1e-6, msg=f"out {case}")
                for name, got, want in zip("qkv", local, full, strict=True):
                    want_grad = want.grad[:, :, idx]
                    torch.testing.assert_close(got.grad, want_grad, rtol=1e-6, atol=1e-6, msg=f"d{name} {case}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_causal_attention(cp):
    """Outputs and dq, dk, dv of every rank's slice equal full causal SDPA's (fp64 inputs;
    the kernel computes in fp32), for both balances and rotations, GQA and odd head dims."""
    mp.spawn(_worker, args=(cp, rendezvous(), [c for c in CASES if c[0] == cp]), nprocs=cp, join=True)


def test_shard_index_zigzag_and_contiguous():
    assert shard_index(16, 2, 0, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_index(16, 2, 1, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_index(16, 2, 1, "none").tolist() == list(range(8, 16))
    cover = torch.cat([shard_index(24, 3, r, "zigzag") for r in range(3)]).sort().values
    assert cover.tolist() == list(range(24))


def _config(tmp_path, corpus, **extra):
    return load_config(None, tiny_overrides(tmp_path, corpus, **extra))


def test_seq_len_not_divisible_is_refused_with_the_key(tmp_path, corpus):
    cfg = _config(tmp_path, corpus, **{"parallel.cp": 2, "train.seq_len": 34})
    with pytest.raises(ConfigError, match=r"train\.seq_len = 34 .*2 x parallel\.cp = 4"):
        resolve(cfg, 2)
    cfg = _config(tmp_path, corpus, **{"parallel.cp": 4, "parallel.cp_balance": "none", "train.seq_len": 34})
    with pytest.raises(ConfigError, match=r"train\.seq_len = 34 .*parallel\.cp = 4"):
        resolve(cfg, 4)


def test_unknown_cp_balance_suggests_the_valid_one(tmp_path, corpus):
    with pytest.raises(ConfigError, match="zigzag"):
        _config(tmp_path, corpus, **{"parallel.cp_balance": "zigzg"})
    with pytest.raises(ConfigError, match="allgather"):
        _config(tmp_path, corpus, **{"parallel.cp_rotate": "all_gather"})


def test_seq_len_under_cp_and_sequence_parallel_is_refused(tmp_path, corpus):
    cfg = _config(tmp_path, corpus, **{"parallel.cp": 2, "parallel.tp": 4, "model.kv_heads": 4, "train.seq_len": 36})
    with pytest.raises(ConfigError, match=r"train\.seq_len = 36 .*parallel\.cp x parallel\.tp = 8"):
        resolve(cfg, 8)


def test_cp_composes_with_hsdp_and_zero1(tmp_path, corpus):
    """No longer refused: HSDP shards over dp_shard x cp and replicates over dp_replicate,
    ZeRO-1 shards the optimizer over dp x cp (their equivalence runs are in LAYOUTS)."""
    over = {"parallel.cp": 2, "parallel.dp_replicate": 2, "parallel.zero_stage": 3, "train.seq_len": 64}
    assert resolve(_config(tmp_path, corpus, **over), 4).layout.dp_replicate == 2
    over = {"parallel.cp": 2, "parallel.zero_stage": 1, "train.seq_len": 64}
    assert resolve(_config(tmp_path, corpus, **over), 2).layout.zero_stage == 1
    over["parallel.tp"] = 2  # ZeRO-1 under tp stays refused (its own rule), cp or not
    with pytest.raises(ConfigError, match=r"parallel\.zero_stage = 1 with parallel\.tp = 2"):
        resolve(_config(tmp_path, corpus, **over), 4)


STEPS = 3
COMMON = {
    "model.hidden": 64,
    "model.heads": 4,
    "model.kv_heads": 2,
    "model.ffn_hidden": 128,
    "model.layers": 2,
    "train.steps": STEPS,
    "train.seq_len": 256,
    "train.global_batch_size": 4,
    "train.micro_batch_size": 2,
    "train.grad_clip": 0.5,
    "train.eval_batches": 1,
    "optim.lr": 1e-3,  # as in test_tensor_parallel.py: Adam turns fp32 round-off into ~lr weight error
}
LAYOUTS = {  # name: (ranks, overrides)
    "cp2-zigzag-ring": (2, {"parallel.cp": 2}),
    "cp2-none-allgather": (2, {"parallel.cp": 2, "parallel.cp_balance": "none", "parallel.cp_rotate": "allgather"}),
    # cp 4: both balances and both rotations in two launches
    "cp4-zigzag-ring": (4, {"parallel.cp": 4}),
    "cp4-none-allgather": (4, {"parallel.cp": 4, "parallel.cp_balance": "none", "parallel.cp_rotate": "allgather"}),
    "cp2-zero1": (2, {"parallel.cp": 2, "parallel.zero_stage": 1}),  # optimizer state sharded over cp
    "cp2-dp_shard2-ddp": (4, {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 0}),
    "cp2-dp_shard2-zero3": (4, {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 3}),
    "cp2-hsdp2": (4, {"parallel.cp": 2, "parallel.dp_replicate": 2, "parallel.zero_stage": 3}),
    "cp2-tp2": (4, {"parallel.cp": 2, "parallel.tp": 2}),
    "cp2-pp2": (4, {"parallel.cp": 2, "parallel.pp": 2}),
    "cp2-tp2-dp_shard2": (8, {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 3}),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("ref") / "run"
    train(tiny_config(d, corpus, **COMMON))
    return d


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, corpus):
    return layout_runner(tmp_path_factory, corpus, LAYOUTS, COMMON)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, layout_runs):
    assert_run_matches(reference, layout_runs(name), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "rotate"), [("cp2-zigzag-ring", "ring"), ("cp2-none-allgather", "allgather")])
def test_cp_bytes_match_the_ring_formula(name, rotate, layout_runs):
    """The bytes counted on the cp axis per step are the ring figure of context_parallel_cost
    (the planner's formula) for every layer and micro-batch: forward (cp-1)/cp of the
    sequence's K and V, backward K and V again and their gradients."""
    cp, heads, layers = 2, COMMON["model.heads"], COMMON["model.layers"]
    micro, micro_batches = COMMON["train.micro_batch_size"], COMMON["train.global_batch_size"] // 2
    tokens = micro * local_tokens(COMMON["train.seq_len"], cp)
    kv_width = COMMON["model.kv_heads"] * COMMON["model.hidden"] // heads
    want = {k: v * layers * micro_batches for k, v in ring_bytes(tokens, kv_width, cp, rotate, 4).items()}
    got = [r["comm_bytes_by_kind"]["cp"] for r in _metrics(layout_runs(name))]
    assert len(got) == STEPS
    if rotate == "ring":
        assert all(g["p2p"] == pytest.approx(sum(want.values()), rel=1e-12) for g in got)
        return
    # cp is the only axis > 1 here, so DDP's gradient all-reduce runs on the same group (dp_cp = cp):
    # what allgather adds to it is the dK/dV all-reduce
    grad_sync = _metrics(layout_runs("cp2-zigzag-ring"))[0]["comm_bytes_by_kind"]["cp"]["all_reduce"]
    for g in got:
        assert g["all_gather"] == pytest.approx(want["forward_kv"] + want["backward_kv"], rel=1e-12)
        assert g["all_reduce"] - grad_sync == pytest.approx(want["backward_grads"], rel=1e-9)


@pytest.mark.slow
def test_cp_ranks_share_parameter_and_optimizer_state(layout_runs):
    """cp ranks hold the same parameters, so they share the sharded state like dp ranks: HSDP
    2 x cp 2 keeps 1/2 of parameters, gradients and Adam state per rank (sharded over
    dp_shard x cp = 2, replicated over dp_replicate), ZeRO-1 under cp 2 a real fraction of Adam's."""
    psi = num_params(load_weights(layout_runs("cp2-hsdp2") / "final").shape)
    mem = _metrics(layout_runs("cp2-hsdp2"))[-1]["state_mem_bytes"]
    assert [mem["params"], mem["grads"], mem["optimizer"]] == pytest.approx([2 * psi, 2 * psi, 4 * psi], rel=1e-3)
    mem = _metrics(layout_runs("cp2-zero1"))[-1]["state_mem_bytes"]
    assert mem["params"] == pytest.approx(4 * psi, rel=1e-3)
    assert 8 * psi / 2 * 0.8 < mem["optimizer"] < 8 * psi * 0.7  # partitioned by whole tensors over the 2 cp ranks


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
