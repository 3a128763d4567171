"""CUDA paths, run by the GPU suite (`bash bench/gpu/run.sh`, or `pytest -m cuda` on a GPU
machine). Without a CUDA device every test here is skipped, with that reason, by conftest.

Each test trains the tiny model of the CPU tests on `cuda:0`: training in bf16 and fp32,
`torch.compile`, activation checkpointing, FSDP2 on a world of one, background checkpoints
with pinned staging and exact resume, and Hugging Face export/import of CUDA weights.
"""

import json

import pytest
import torch

from conftest import assert_same_weights, cli_args, run_cli, tiny_config, tiny_overrides, train

pytestmark = pytest.mark.cuda

CUDA = {"train.device": "cuda", "train.steps": 12, "optim.warmup_steps": 2, "train.eval_batches": 1}


def records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_trains_on_cuda(precision, tmp_path, corpus):
    d = tmp_path / "run"
    summary = train(tiny_config(d, corpus, **CUDA, **{"train.precision": precision}))
    start = next(e for e in events(d) if e["event"] == "run_start")
    assert "cuda" in str(start.get("device", "")), start
    recs = records(d)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert all(r["peak_mem_gib"] > 0 for r in recs)  # torch.cuda.max_memory_allocated was read
    assert summary["mfu"] > 0


def test_bf16_default_on_cuda(tmp_path, corpus):
    """`precision = "auto"` means bf16 on CUDA (fp32 on CPUs)."""
    d = tmp_path / "run"
    train(tiny_config(d, corpus, **CUDA))
    assert 'precision = "bf16"' in (d / "config.toml").read_text()


def test_compile_matches_eager(tmp_path, corpus):
    """fp32, deterministic: a compiled run's losses equal the eager run's to compiler noise."""
    over = {**CUDA, "train.precision": "fp32", "train.deterministic": True}
    train(tiny_config(tmp_path / "eager", corpus, **over))
    train(tiny_config(tmp_path / "compiled", corpus, **over, **{"train.compile": True}))
    a, b = records(tmp_path / "eager"), records(tmp_path / "compiled")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-4)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_matches(mode, tmp_path, corpus):
    over = {**CUDA, "train.precision": "fp32", "train.deterministic": True}
    train(tiny_config(tmp_path / "plain", corpus, **over))
    train(tiny_config(tmp_path / "ac", corpus, **over, **{"train.activation_checkpoint": mode}))
    a, b = records(tmp_path / "plain"), records(tmp_path / "ac")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    # Peak memory on this tiny model is dominated by parameters and allocator noise (it failed
    # once of two runs on an H100); what AC changes is what autograd saves, measured below.
    assert saved_activation_bytes(mode) < saved_activation_bytes("none")


def saved_activation_bytes(mode: str, device: str = "cuda") -> int:
    """Bytes autograd saves for backward in one forward of a model whose activations dominate
    (seq 512, hidden 64), with activation checkpointing ``mode`` ("none", "full", "selective")."""
    from meshforge.models.llama import Transformer
    from meshforge.models.shape import ModelShape
    from meshforge.parallel.activation_checkpoint import apply_activation_checkpoint

    args = ModelShape(hidden=64, layers=4, heads=4, kv_heads=2, ffn_hidden=256, vocab_size=256, max_seq_len=512)
    torch.manual_seed(0)
    model = Transformer(args).to(device)
    if mode != "none":
        apply_activation_checkpoint(list(model.layers.values()), mode)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == torch.device(device).type:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 256, (4, 512), device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).float().sum().backward()
    return sum(seen.values())


def test_fsdp2_world_of_one(tmp_path):
    """FSDP2 over a one-GPU mesh (NCCL): one step equals the unsharded model's step."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshforge.models.llama import ModelShape, build_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        args = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64)
        ref = build_model(args, device="cuda", seed=0)
        sharded = build_model(args, device="cuda", seed=1)
        sharded.load_state_dict(ref.state_dict())
        mesh = init_device_mesh("cuda", (1,))
        for block in sharded.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        x = torch.randint(0, 256, (2, 32), device="cuda")
        for m in (ref, sharded):
            m(x).float().square().mean().backward()
        for (n, p), q in zip(ref.named_parameters(), sharded.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad.full_tensor(), rtol=1e-4, atol=1e-6), n
    finally:
        dist.destroy_process_group()


def test_background_checkpoints_are_pinned_and_resume_exactly(tmp_path, corpus):
    """Async saves stage through pinned host memory; killed after step 6, the run resumes
    from step 4 and ends with the uninterrupted run's weights."""
    from meshforge.checkpoint.sharded import staging_is_pinned

    assert staging_is_pinned()
    over = {**CUDA, "train.precision": "fp32", "train.deterministic": True}
    over_ckpt = {**over, "checkpoint.interval": 4, "checkpoint.async": True}
    train(tiny_config(tmp_path / "clean", corpus, **over))
    d = tmp_path / "run"
    args = cli_args(tiny_overrides(d, corpus, **over_ckpt))
    r = run_cli("train", *args, env={"MESHFORGE_FAULT": "kill:rank=0:step=6"})
    assert r.returncode == -9
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [r["loss"] for r in records(d)] == pytest.approx([r["loss"] for r in records(tmp_path / "clean")])
    assert_same_weights(tmp_path / "clean", d)


def test_hf_export_import_on_cuda(tmp_path):
    """CUDA weights exported to a Hugging Face directory load back (and into transformers)
    with the same logits."""
    from meshforge.models.hf import load_hf_checkpoint, save_hf_checkpoint
    from meshforge.models.llama import ModelShape, build_model

    args = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64)
    model = build_model(args, device="cuda", seed=0).eval()
    save_hf_checkpoint(model, tmp_path / "hf")
    back = load_hf_checkpoint(tmp_path / "hf", device="cuda").eval()
    x = torch.randint(0, 256, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.allclose(model(x), back(x), atol=1e-5)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        assert torch.allclose(model(x).float(), hf(x).logits.float(), atol=1e-4)


def test_ring_attention_block_kernels_on_cuda():
    """bf16 blocks run on the fused CUDA kernel (not the math fallback) and agree with math."""
    import math

    from meshforge.parallel.context import kernels as ak

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    kernel = ak.pick_kernel(q)
    assert kernel in ("flash_cuda", "efficient_cuda"), kernel
    out, lse, _ = ak.block_forward(q, k, v, True, 1 / math.sqrt(64), kernel)
    want, want_lse, _ = ak.block_forward(q, k, v, True, 1 / math.sqrt(64), "math")
    assert torch.allclose(out, want, atol=2e-2) and torch.allclose(lse, want_lse, atol=2e-2)


def test_moe_grouped_gemm_on_cuda():
    """torch._grouped_mm runs here in bf16 and equals the loop over experts."""
    from meshforge.models.moe import grouped_matmul, grouped_mm_supported

    assert grouped_mm_supported(torch.device("cuda"), torch.bfloat16)
    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([40, 0, 16, 40], device="cuda")
    got, want = grouped_matmul(x, w, counts, grouped=True), grouped_matmul(x, w, counts, grouped=False)
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-1)


def test_fp8_trains_with_real_fp8_matmuls(tmp_path, corpus):
    """On compute capability >= 8.9, fp8 is real (_scaled_mm), not emulated; the loss falls."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability >= 8.9")
    d = tmp_path / "run"
    train(tiny_config(d, corpus, **CUDA, **{"train.precision": "fp8", "model.hidden": 128, "model.ffn_hidden": 256}))
    ev = next(e for e in events(d) if e["event"] == "fp8_modules")
    assert ev.get("converted") and ev["emulated"] is False, ev
    recs = records(d)
    assert recs[-1]["loss"] < recs[0]["loss"]
