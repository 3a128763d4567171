"""The torchtitan side of the GPU suite's MFU comparison: the same model shape trained by
torchtitan 0.3.0 (its PyPI release) on one device, measured the way meshforge measures.

Prints one JSON line on stdout (everything else goes to stderr) so bench/gpu/bench_mfu.py
can put tokens/s, MFU and peak memory beside meshforge's figures as ratios.

What is torchtitan's (unchanged, as its own llama3 configs use it):
- the model: ``torchtitan.models.llama3.model_registry("1B" | "3B")`` (dim 2048/3072, 16/28
  layers, 32/24 heads, 8 kv heads, ffn 8192, vocab 128256, rope theta 500000, tied
  embeddings: the Llama 3.2 shapes; a check below compares its parameter count with
  meshforge's preset and refuses to run on a mismatch). ``--smoke`` uses its
  ``debugmodel`` flavor. Its attention is FlexAttention (0.3.0 has no SDPA backend for
  language models; ``--attn`` picks flex, flex_flash or varlen);
- the Trainer (``torchtitan.trainer.Trainer``): its training loop and train_step, its
  ``parallelize_llama`` (activation checkpointing, per-block ``torch.compile``, FSDP2 on a
  world of one for the mixed-precision policy: fp32 parameters, bf16 compute), its AdamW
  (``default_adamw``, fused), LR schedule, gradient clipping, chunked cross-entropy loss,
  GC handling and, by default, CUDA-graph capture of forward+backward.

What is ours (so it runs with no network and no HF assets):
- the data: ``RandomTokens``, a torchtitan dataloader component yielding uniform random
  token ids with positions 0..seq_len-1 (one document per row, so the attention mask is
  plain causal, as in meshforge's benchmark);
- ``NoTokenizer``: the Trainer always builds a tokenizer; our data never uses it;
- a placeholder ``datasets`` module when the real one is absent: torchtitan imports it at
  module level only for its HF dataloaders, which this script does not use (``datasets``
  pulls pyarrow, 40+ MiB per Python version, too big to carry with the tree);
- ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step and
  torch 2.13 does not have, is aliased to ``distributed_c10d._set_pg_timeout`` where absent;
- the measurement: one device sync before the first timed step and one after the last;
  tokens/s over the timed steps; FLOPs per token from ``meshforge.models.flops`` and the
  peak from ``meshforge.metrics.mfu`` (so MFU is counted exactly as meshforge counts it);
  peak memory from ``meshforge.metrics.memory.peak_mem_gib`` (CUDA max allocated);
- ``--smoke`` on a machine without CUDA (tests the wiring only, not speed): torchtitan 0.3.0
  assumes CUDA when no accelerator is found, so its device globals are pointed at a small
  CPU shim; and FlexAttention has no backward on CPU, so its kernel call is replaced by
  causal SDPA (same result for one document per row). Neither happens on a GPU.

    python bench/gpu/bench_torchtitan.py --model llama3.2-1b --seq-len 4096 --compile --ac none
    python bench/gpu/bench_torchtitan.py --model llama3.2-3b --seq-len 8192 --no-compile --ac full
    python bench/gpu/bench_torchtitan.py --smoke          # tiny flavor, CPU, a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from typing import Any

import torch

from meshforge.metrics.memory import peak_mem_gib
from meshforge.metrics.mfu import peak_flops, utilization
from meshforge.models import flops
from meshforge.models.presets import get_preset
from meshforge.models.shape import ModelShape

FLAVORS = {"llama3.2-1b": "1B", "llama3.2-3b": "3B", "debug": "debugmodel"}
# torchtitan's debugmodel flavor (dim 256, 16 heads, no GQA, ffn 768, vocab 2048, untied).
DEBUG_SHAPE = ModelShape(
    hidden=256, layers=6, heads=16, kv_heads=16, ffn_hidden=768, vocab_size=2048, max_seq_len=131072
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(FLAVORS), default="llama3.2-1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per step (no accumulation)")
    p.add_argument("--steps", type=int, default=13, help="all steps, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compile, CUDA-graph capture)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--ac", choices=["none", "full"], default="none", help="activation checkpointing")
    p.add_argument("--attn", choices=["flex", "flex_flash", "varlen"], default="flex")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torchtitan's default; --no-cuda-graphs to run forward+backward eagerly",
    )
    p.add_argument("--smoke", action="store_true", help="debug flavor, seq 128, batch 2, 4 steps; runs on CPU too")
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.seq_len, a.micro_batch, a.steps, a.warmup = "debug", 128, 2, 4, 2
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must be greater than --warmup ({a.warmup})")
    return a


def install_datasets_placeholder() -> None:
    """Register a stand-in ``datasets`` module when the real one is absent (see the docstring)."""
    try:
        import datasets  # noqa: F401
    except ImportError:

        def missing(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("HF datasets is not installed; bench_torchtitan.py feeds random tokens")

        ds = types.ModuleType("datasets")
        dd = types.ModuleType("datasets.distributed")
        ds.Dataset, ds.load_dataset, ds.distributed = type("Dataset", (), {}), missing, dd
        dd.split_dataset_by_node = missing
        sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dd


class _CpuDevice:
    """The few ``torch.cuda`` calls torchtitan makes, answered for the CPU (``--smoke`` only)."""

    set_device = empty_cache = reset_peak_memory_stats = synchronize = staticmethod(lambda *a, **k: None)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: 0)
    get_device_name = staticmethod(lambda *a: "cpu")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    get_device_properties = staticmethod(lambda *a: types.SimpleNamespace(total_memory=_CpuDevice.ram))
    memory_stats = staticmethod(lambda *a: {})
    memory = types.SimpleNamespace()


def point_torchtitan_at_cpu() -> None:
    """torchtitan 0.3.0 picks "cuda" when no accelerator is found; rebind its device globals."""
    import importlib

    for name in (
        "tools.utils",
        "components.metrics",
        "models.common.token_dispatcher",
        "distributed.parallel_dims",
        "distributed.utils",
        "tools.profiler",
    ):
        mod = importlib.import_module(f"torchtitan.{name}")
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = _CpuDevice


def cpu_attention_stand_in() -> None:
    """FlexAttention has no CPU backward: answer its kernel call with causal SDPA (``--smoke`` only)."""
    import torch.nn.functional as F
    from torchtitan.models.common.attention import FlexAttention

    def sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None, enable_gqa: bool, **_flex: Any
    ) -> tuple[torch.Tensor, None]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None

    FlexAttention._compiled_flex_attn = staticmethod(sdpa)


def provide_set_timeout() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout``; older torch names it ``_set_pg_timeout``."""
    import torch.distributed.distributed_c10d as c10d

    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = c10d._set_pg_timeout


def set_single_process_env() -> None:
    """What torchrun would set for a world of one, unless the caller already did."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
    ):
        os.environ.setdefault(k, v)


def define_components() -> tuple[type, type]:
    """Our data and tokenizer as torchtitan components.

    Defined after torchtitan is importable (and, on CPU, after the device rebinding)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Any, tokenizer_path: str = "") -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise RuntimeError("bench_torchtitan.py trains on random token ids; nothing is tokenized")

        decode = encode

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0

        def __init__(self, config: Any, *, seq_len: int, local_batch_size: int, **_runtime: Any) -> None:
            self.vocab, self.seq_len, self.batch = config.vocab_size, seq_len, local_batch_size
            self.gen = torch.Generator().manual_seed(0)

        def __iter__(self):  # yields torchtitan's ({input, positions}, labels) pairs
            positions = torch.arange(self.seq_len).expand(self.batch, -1)
            while True:
                ids = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=self.gen)
                yield {"input": ids[:, :-1], "positions": positions}, ids[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return NoTokenizer, RandomTokens


def define_timed_trainer() -> type:
    """torchtitan's Trainer with a clock around the timed steps."""
    from torchtitan.trainer import Trainer

    class TimedTrainer(Trainer):
        """torchtitan's Trainer; only syncs before the first timed step and after the last."""

        warmup: int = 0
        t0: float = 0.0
        t1: float = 0.0
        last_loss: float = float("nan")

        def train_step(self, data_iterator: Any) -> None:
            if self.step == self.warmup + 1:
                _sync(self.device)
                self.t0 = time.perf_counter()
            super().train_step(data_iterator)
            if self.step == self.config.training.steps:
                _sync(self.device)
                self.t1 = time.perf_counter()

    return TimedTrainer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_config(a: argparse.Namespace, tok_cls: type, data_cls: type, dump: str) -> Any:
    """A Trainer.Config in the style of torchtitan's own llama3 configs, with our data."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry(FLAVORS[a.model], attn_backend=a.attn)
    vocab = decoder_vocab_size(spec)
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=dump,
        dump_folder=dump,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        tokenizer=tok_cls.Config(vocab_size=vocab),
        dataloader=data_cls.Config(vocab_size=vocab),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=a.warmup),
        training=TrainingConfig(
            local_batch_size=a.micro_batch,
            seq_len=a.seq_len,
            steps=a.steps,
            mixed_precision_param="bfloat16" if a.precision == "bf16" else "float32",
            disable_cuda_graphs=not a.cuda_graphs,
        ),
        metrics=MetricsProcessor.Config(log_freq=a.steps),  # loss read (a sync) on steps 1 and last only
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=FullAC.Config() if a.ac == "full" else None,
        compile=CompileConfig(enable=a.compile, components=["model", "loss"]),
        debug=DebugConfig(seed=0, enable_structured_logging=False),
    )


def meshforge_shape(a: argparse.Namespace) -> ModelShape:
    """The meshforge preset this run compares with (for the FLOPs and the shape check)."""
    return DEBUG_SHAPE if a.model == "debug" else get_preset(a.model)


def check_same_shape(model: torch.nn.Module, shape: ModelShape) -> int:
    """Refuse to report a comparison of two different models: parameter counts must agree."""
    n = sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once
    if n != flops.num_params(shape):
        raise SystemExit(f"torchtitan's model has {n:,} parameters, meshforge's shape {flops.num_params(shape):,}")
    return n


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Build torchtitan's Trainer for this config, train, and measure."""
    install_datasets_placeholder()
    provide_set_timeout()
    if not torch.cuda.is_available():
        if not a.smoke:
            raise SystemExit("no CUDA device: only --smoke runs on CPU")
        point_torchtitan_at_cpu()
        cpu_attention_stand_in()
    set_single_process_env()
    (tok_cls, data_cls), trainer_cls = define_components(), define_timed_trainer()
    with tempfile.TemporaryDirectory(prefix="bench_torchtitan_") as dump:
        trainer = trainer_cls(build_config(a, tok_cls, data_cls, dump))
        trainer.warmup = a.warmup
        log = trainer.metrics_processor.log

        def keep_loss(step: int, loss: float, *rest: Any, **kw: Any) -> Any:
            trainer.last_loss = loss
            return log(step, loss, *rest, **kw)

        trainer.metrics_processor.log = keep_loss
        try:
            n_params = check_same_shape(trainer.model_parts[0], meshforge_shape(a))
            trainer.train()
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return measure(a, trainer, n_params)


def measure(a: argparse.Namespace, trainer: Any, n_params: int) -> dict[str, Any]:
    """tokens/s, MFU and HFU counted with meshforge's FLOPs and peak, and peak memory."""
    import torchtitan

    shape, device = meshforge_shape(a), trainer.device
    seconds = trainer.t1 - trainer.t0
    tokens_per_s = (a.steps - a.warmup) * a.micro_batch * a.seq_len / seconds
    peak = peak_flops(device, a.precision)
    model_f = flops.model_flops_per_token(shape, a.seq_len)
    hw_f = flops.hardware_flops_per_token(shape, a.seq_len, recompute=a.ac)
    return {
        "framework": "torchtitan",
        "torchtitan_version": getattr(torchtitan, "__version__", "?"),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": a.model,
        "params": n_params,
        "seq_len": a.seq_len,
        "micro_batch": a.micro_batch,
        "precision": a.precision,
        "compile": a.compile,
        "ac": a.ac,
        "attn": a.attn,
        "cuda_graphs": a.cuda_graphs and device.type == "cuda",  # torchtitan runs eagerly elsewhere
        "steps": a.steps,
        "warmup": a.warmup,
        "step_time_s": seconds / (a.steps - a.warmup),
        "tokens_per_s": tokens_per_s,
        "mfu": utilization(model_f, tokens_per_s, peak),
        "hfu": utilization(hw_f, tokens_per_s, peak),
        "model_flops_per_token": model_f,
        "torchtitan_flops_per_token": float(trainer.metrics_processor.num_flops_per_token),
        "peak_flops": peak,
        "peak_mem_gib": peak_mem_gib(device),
        "final_loss": float(trainer.last_loss),
    }


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[titan] %(levelname)s %(message)s")
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
        result = run(a)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
