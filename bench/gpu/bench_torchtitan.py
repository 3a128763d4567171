"""The peer in the GPU suite: torchtitan's Llama 3 model trained with torchtitan's single-GPU
recipe, measured the way meshforge measures, so bench/gpu/bench_mfu.py can print ratios.

Works with torchtitan 0.2.2 (the one that imports on torch 2.11) and 0.3.0 (torch >= 2.13).
What is torchtitan's: the model -- 0.2.2's ``Transformer(TransformerModelArgs)`` (SDPA, causal)
with the shape of meshforge's preset, or 0.3.0's ``model_registry("1B"|"3B"|"8B")`` (FlexAttention,
causal mask from positions). The recipe is torchtitan's ``parallelize_llama`` for one GPU, written
out with the same torch APIs so it is the same on both versions and can accumulate:
full activation checkpointing per block (``--ac full``), per-block ``torch.compile(fullgraph=True)``
(``--compile``), FSDP2 ``fully_shard`` per block and at the root on a world of one with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 master weights) and, on this world
of one, ``reshard_after_forward=False`` on the blocks (torchtitan's ``parallelism.fsdp_reshard_after_forward
= "never"``: the blocks keep their bf16 weights from forward to backward instead of casting them again,
as a careful single-GPU user sets it; ``--reshard-after-forward default`` is torchtitan's default, which
reshards them: the peer of the runs recorded before issue 37), optional
``CPUOffloadPolicy`` (``--offload``, torchtitan's ``training.enable_cpu_offload``), torchao float8
tensorwise on every block Linear (``--fp8``, torchtitan's float8 converter; the head stays bf16),
cross-entropy in fp32 (compiled with ``--compile``, as torchtitan compiles its loss), fused
AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1) and grad-norm clipping at 1.0.

Fairness: ``--accum N`` accumulates N micro-batches per optimizer step, so tokens per optimizer
step equal meshforge's global batch. Data: uniform random token ids (no tokenizer, no network).
Measurement: one sync before the first timed step and one after the last; MFU from
``meshforge.models.flops`` and ``meshforge.metrics.mfu`` (counted as meshforge counts);
``--profile-dir`` traces one step after the timed ones (Chrome trace, for trace_summary.py).

    python bench/gpu/bench_torchtitan.py --model llama3.2-1b --seq-len 4096 --micro-batch 2 --accum 8 --compile
    python bench/gpu/bench_torchtitan.py --smoke      # tiny shape, CPU, one JSON line
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import types
from typing import Any

import torch
import torch.nn.functional as F

from meshforge.metrics.memory import peak_mem_gib
from meshforge.metrics.mfu import peak_flops, utilization
from meshforge.models import flops
from meshforge.models.presets import get_preset
from meshforge.models.shape import ModelShape

FLAVORS_030 = {"llama3.2-1b": "1B", "llama3.2-3b": "3B", "llama3.1-8b": "8B"}
SMOKE_SHAPE = ModelShape(
    hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=256, vocab_size=512, max_seq_len=128, rope_theta=500000.0
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*FLAVORS_030, "smoke"], default="llama3.2-1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--ac", choices=["none", "full"], default="none")
    p.add_argument("--fp8", action="store_true", help="torchao float8 tensorwise on the block Linears")
    p.add_argument("--offload", action="store_true", help="FSDP2 CPUOffloadPolicy (params, grads, optimizer)")
    p.add_argument(
        "--reshard-after-forward",
        choices=["never", "default"],
        default="never",
        help="torchtitan's parallelism.fsdp_reshard_after_forward for the blocks: never (the strongest "
        "single-GPU recipe: bf16 weights kept), default (torchtitan's default without pipelining: reshard)",
    )
    p.add_argument("--profile-dir", default="", help="trace one extra step into this folder")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU in fp32: checks the wiring")
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.seq_len, a.micro_batch, a.accum, a.steps, a.warmup = "smoke", 64, 2, 2, 3, 1
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must be greater than --warmup ({a.warmup})")
    return a


def install_datasets_placeholder() -> None:
    """A stand-in ``datasets`` module where the real one is absent: torchtitan imports it at module
    level for its HF dataloaders only (unused here); it pulls pyarrow, too big to carry."""
    try:
        import datasets  # noqa: F401
    except ImportError:

        def missing(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("HF datasets is not installed; bench_torchtitan.py feeds random tokens")

        ds, dd = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        ds.Dataset, ds.IterableDataset, ds.load_dataset, ds.distributed = type("Dataset", (), {}), object, missing, dd
        dd.split_dataset_by_node = missing
        sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dd


@functools.cache
def tt_version() -> str:
    """The installed torchtitan release (read once: the API differs between 0.2.2 and 0.3.0)."""
    import importlib.metadata as md

    return md.version("torchtitan")


def shape_of(a: argparse.Namespace) -> ModelShape:
    """meshforge's preset for this run: the shape both sides train and the FLOPs count."""
    return SMOKE_SHAPE if a.model == "smoke" else get_preset(a.model)


def build_022(shape: ModelShape, seq_len: int, device: torch.device) -> torch.nn.Module:
    """torchtitan 0.2.2's Llama 3 Transformer with meshforge's preset's shape (SDPA, causal)."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    base = int(2 * 4 * shape.hidden / 3)  # torchtitan: ffn = multiple_of-round(multiplier * 8/3 * dim)
    args = TransformerModelArgs(
        dim=shape.hidden,
        n_layers=shape.layers,
        n_heads=shape.heads,
        n_kv_heads=shape.kv_heads,
        vocab_size=shape.vocab_size,
        ffn_dim_multiplier=shape.ffn_hidden / base,
        multiple_of=min(256, shape.ffn_hidden),
        rope_theta=shape.rope_theta,
        max_seq_len=seq_len,
    )
    with torch.device(device):
        model = Transformer(args)
    if device.type != "meta":
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    if shape.tie_embeddings:  # Llama 3.2: one matrix for embedding and head, before FSDP groups it
        model.output.weight = model.tok_embeddings.weight
    return model


def build_030(a: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """torchtitan 0.3.0's own Llama 3 flavor (FlexAttention; it has no SDPA backend)."""
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry(FLAVORS_030.get(a.model, "debugmodel"), attn_backend="flex").model
    with torch.device(device):
        model = cfg.build()
    if device.type != "meta":
        with torch.no_grad():
            model.init_states(buffer_device=device)
    return model


def check_same_shape(model: torch.nn.Module, shape: ModelShape) -> int:
    """Refuse to report a comparison of two different models: parameter counts must agree."""
    n = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    if n != flops.num_params(shape):
        raise SystemExit(f"torchtitan's model has {n:,} parameters, meshforge's shape {flops.num_params(shape):,}")
    return n


def apply_recipe(model: torch.nn.Module, a: argparse.Namespace, bf16: bool) -> None:
    """torchtitan's single-GPU parallelize_llama: fp8, AC, per-block compile, FSDP2 (mixed precision)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if a.fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        keep = {id(model.output if hasattr(model, "output") else model.lm_head)}
        convert_to_float8_training(
            model, config=Float8LinearConfig(), module_filter_fn=lambda m, _fqn: id(m) not in keep
        )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw: dict[str, Any] = {"mp_policy": mp} if mp else {}
    if a.offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for name, block in list(model.layers.named_children()):
        if a.ac == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if a.compile:
            block = torch.compile(block, fullgraph=True)
        model.layers.register_module(name, block)
        fully_shard(block, reshard_after_forward=a.reshard_after_forward != "never", **kw)
    fully_shard(model, **kw)


def build_model(a: argparse.Namespace, device: torch.device, bf16: bool) -> tuple[torch.nn.Module, int]:
    """The model on its device with the recipe applied; meta + to_empty where offload needs it."""
    v030 = tt_version().startswith("0.3")
    where = torch.device("meta") if a.offload else device
    model = build_030(a, where) if v030 else build_022(shape_of(a), a.seq_len, where)
    n = check_same_shape(model, shape_of(a))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=1, rank=0)
    apply_recipe(model, a, bf16)
    if a.offload:  # as torchtitan: parameters on CPU, buffers (RoPE) on the GPU
        model.to_empty(device="cpu")
        with torch.no_grad():
            (model.init_states if v030 else model.init_weights)(buffer_device=device)
    return model, n


def make_step(model: torch.nn.Module, a: argparse.Namespace, device: torch.device) -> Any:
    """One optimizer step over ``accum`` micro-batches of random tokens; returns the loss tensor."""
    v030 = tt_version().startswith("0.3")
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=not a.offload or device.type == "cpu"
    )
    vocab = shape_of(a).vocab_size
    pos = torch.arange(a.seq_len, device=device).expand(a.micro_batch, -1)
    masks = model.get_attention_masks(pos) if v030 else None

    def ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    loss_fn = torch.compile(ce) if a.compile else ce
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for _ in range(a.accum):
            ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), device=device, generator=gen)
            logits = model(ids[:, :-1], pos, masks) if v030 else model(ids[:, :-1])
            loss = loss_fn(logits, ids[:, 1:]) / a.accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Any, a: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """Seconds over the timed steps and the last loss (one sync before, one after)."""
    for _ in range(a.warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(a.steps - a.warmup):
        loss = step()
    _sync(device)
    return time.perf_counter() - t0, float(loss)


def profile_one(step: Any, out: str, device: torch.device) -> str:
    """Trace one step (after the timed ones) into ``out``/peer.json."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:  # shapes: kernel_diff.py's GEMM rows
        with record_function("peer step"):  # the traced step's span, as meshforge marks its own
            step()
            _sync(device)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "peer.json")
    prof.export_chrome_trace(path)
    return path


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Build, train, measure (and optionally profile one step)."""
    install_datasets_placeholder()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not a.smoke:
        raise SystemExit("no CUDA device: only --smoke runs on CPU")
    if cuda:
        torch.cuda.set_device(0)
    if not cuda and tt_version().startswith("0.3"):  # FlexAttention has no CPU backward: build only
        n = sum(p.numel() for p in build_030(a, torch.device("meta")).parameters())
        return {"framework": "torchtitan", "torchtitan_version": tt_version(), "smoke": "built on meta", "params": n}
    model, n_params = build_model(a, device, bf16=cuda)
    step = make_step(model, a, device)
    seconds, loss = timed(step, a, device)
    peak = peak_mem_gib(device)
    trace = profile_one(step, a.profile_dir, device) if a.profile_dir else ""
    torch.distributed.destroy_process_group()
    return measure(a, device, n_params, seconds, loss) | {"peak_mem_gib": peak, "trace": trace}


def measure(a: argparse.Namespace, device: torch.device, n_params: int, seconds: float, loss: float) -> dict:
    """tokens/s, MFU and HFU with meshforge's FLOPs count and peak."""
    shape, timed_steps = shape_of(a), a.steps - a.warmup
    tokens_per_s = timed_steps * a.accum * a.micro_batch * a.seq_len / seconds
    prec = "bf16" if device.type == "cuda" else "fp32"
    peak = peak_flops(device, prec)
    model_f = flops.model_flops_per_token(shape, a.seq_len)
    hw_f = flops.hardware_flops_per_token(shape, a.seq_len, recompute=a.ac)
    ran = f"torchtitan {tt_version()} model, FSDP2 1-GPU {prec}/fp32-reduce, {'compiled' if a.compile else 'eager'}"
    ran += f", AC {a.ac}" + (", fp8" if a.fp8 else "") + (", offload" if a.offload else "")
    ran += f", reshard after forward {a.reshard_after_forward}"
    return {
        "framework": "torchtitan",
        "ran": ran + f", mb {a.micro_batch} x accum {a.accum}",
        "torchtitan_version": tt_version(),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": a.model,
        "params": n_params,
        "seq_len": a.seq_len,
        "micro_batch": a.micro_batch,
        "accum": a.accum,
        "step_time_s": seconds / timed_steps,
        "tokens_per_s": tokens_per_s,
        "mfu": utilization(model_f, tokens_per_s, peak),
        "hfu": utilization(hw_f, tokens_per_s, peak),
        "final_loss": loss,
    }


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
        result = run(a)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
