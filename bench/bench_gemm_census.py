"""GEMM census of one training step, meshforge against the peer, eager and compiled (issue 48).

Every matmul-like op that really runs in one step (one micro-batch: forward, loss, backward,
clipping, AdamW) is recorded by ``meshforge.metrics.gemm_census.GemmCensus``, a TorchDispatchMode
around the step, with its shape, dtypes, operand layouts and FLOPs, and sorted into kinds:
forward, input gradient, weight gradient, recomputation, loss head, attention core. Compiled
steps: a warm-up step compiles, then the census step runs under the mode, which sees the aten
calls of the compiled code (inductor leaves matmuls to ``extern_kernels.mm`` and SDPA to its aten
kernel on CPU; the census checks the total against the model's count, so a GEMM inductor turned
into its own kernel would show as a shortfall).

Both sides train the llama3.2-1b preset's shape with ``--layers`` blocks on the same tokens in
bf16 the way the GPU suite's recipe does: fp32 master weights, bf16 parameters through FSDP2's
``MixedPrecisionPolicy(bf16, reduce fp32)`` on a world of one (gloo here, NCCL on a GPU):

- meshforge: ``meshforge train``'s own parts (resolve, parallelize, loss, optimizer, PlainStep) with
  ``train.mixed_precision = "cast_once"`` (the CUDA default) and the default chunked loss
  (``train.loss_chunk_size = 1024``).
- peer: torchtitan 0.2.2's Llama 3 ``Transformer`` (SDPA, causal) with its single-GPU recipe as
  bench/gpu/bench_torchtitan.py writes it (per-block compile, FSDP2, whole-logits head, fp32
  cross-entropy, compiled with ``--compile``). torchtitan is not a dependency: install it beside
  (``pip install --no-deps --target DIR torchtitan==0.2.2 tyro==1.0.17 torchdata==0.11.0``, plus
  ``docstring_parser typeguard``) and put DIR on PYTHONPATH. On a machine without triton (CPU) its
  MoE kernels' module imports triton: a stand-in is installed for that import only.

    PYTHONPATH=src:bench:DIR python bench/bench_gemm_census.py [--layers 2 --seq-len 768 --micro-batch 2]
    python bench/bench_gemm_census.py --tiny      # small shape, seconds: checks the wiring
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshforge.metrics.gemm_census import KINDS, GemmCensus, ModelDims, expected_flops
from meshforge.models import flops
from meshforge.models.presets import get_preset
from meshforge.models.shape import ModelShape

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
TINY = {"hidden": 128, "heads": 4, "kv_heads": 2, "ffn_hidden": 512, "vocab_size": 1000}
GROUPS = {  # the brief's kinds: what the side-by-side table sums
    "forward": ("forward", "attention"),
    "input gradient": ("input_grad", "attention_grad"),
    "weight gradient": ("weight_grad",),
    "recomputation": ("recompute", "attention_recompute"),
    "loss head": ("head",),
    "unclassified": ("other",),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2, help="blocks of the llama3.2-1b shape")
    p.add_argument("--seq-len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences in the step's one micro-batch")
    ac_help = "activation checkpointing of the blocks (no selective: the peer's recipe has none)"
    p.add_argument("--ac", choices=["none", "full"], default="none", help=ac_help)
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--tiny", action="store_true", help="hidden 128, vocab 1000, seq 96 x 2: seconds, not minutes")
    p.add_argument("--rows", type=int, default=40, help="distinct GEMMs listed per side and mode")
    a = p.parse_args(argv)
    if a.tiny:
        a.seq_len, a.micro_batch = 96, 2
    return a


def shape_of(a: argparse.Namespace) -> ModelShape:
    """The llama3.2-1b preset with ``--layers`` blocks (``--tiny``: narrower too)."""
    extra = TINY if a.tiny else {}
    s = get_preset("llama3.2-1b")
    return dataclasses.replace(s, layers=a.layers, max_seq_len=a.seq_len, head_dim=0, **extra)  # 0: hidden / heads


def import_torchtitan() -> Any:
    """bench_torchtitan (the peer's recipe) with torchtitan imported; a triton stand-in only while
    torchtitan's modules load (its MoE kernels import triton at module level; torch has already
    imported what it needs of inductor, so torch's own triton checks never see the stand-in)."""
    import bench_torchtitan as bt
    import torch._dynamo.repro.after_dynamo  # noqa: F401  (before the stand-in: inductor probes triton)
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    bt.install_datasets_placeholder()
    stub = "triton" not in sys.modules and not _has("triton")
    if stub:
        tr, tl = types.ModuleType("triton"), types.ModuleType("triton.language")
        tr.jit, tr.language, tr.__path__, tl.constexpr = (lambda f=None, **_k: f or (lambda g: g)), tl, [], object
        tr.__file__, tl.__file__ = "<stand-in>/triton/__init__.py", "<stand-in>/triton/language.py"
        tl.__getattr__ = _stand_in_attr
        sys.modules |= {"triton": tr, "triton.language": tl}
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"torchtitan is not importable ({e}); see this file's docstring") from e
    finally:
        if stub:
            del sys.modules["triton"], sys.modules["triton.language"]
    return bt


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _stand_in_attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return lambda *_a, **_k: None


def meshforge_step(a: argparse.Namespace, compiled: bool) -> tuple[Callable[[], Any], torch.nn.Module, str]:
    """meshforge's own step runner over the shape, cast_once bf16, the default chunked loss."""
    from meshforge.config import load_config
    from meshforge.parallel.mesh import build_mesh
    from meshforge.resolve import resolve
    from meshforge.train.standalone_step import standalone_step

    s = shape_of(a)
    over = {f"model.{k}": getattr(s, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden")}
    over |= {"model.preset": "llama3.2-1b", "model.vocab_size": s.vocab_size, "model.max_seq_len": a.seq_len}
    over |= {"train.seq_len": a.seq_len, "train.global_batch_size": a.micro_batch}
    over |= {"train.micro_batch_size": a.micro_batch, "train.precision": "bf16", "train.device": "cpu"}
    over |= {"train.mixed_precision": "cast_once", "train.compile": compiled, "train.activation_checkpoint": a.ac}
    plan = resolve(load_config(overrides=over), 1)
    built = standalone_step(plan, build_mesh(plan.layout, "cpu"))
    runner = built.runner
    batch = torch.randint(0, s.vocab_size, (a.micro_batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    ran = f"meshforge: cast_once bf16 (FSDP2, 1 rank), chunked loss {plan.train.loss_chunk_size} tokens"
    return (lambda: runner.run(batch, measure=False)), built.model, ran


def peer_step(a: argparse.Namespace, compiled: bool) -> tuple[Callable[[], Any], torch.nn.Module, str]:
    """torchtitan's model with its single-GPU recipe (bench_torchtitan.apply_recipe), bf16 FSDP2,
    whole-logits head, fp32 cross-entropy (compiled with the blocks), fused AdamW, clipping."""
    import torch.nn.functional as F

    bt = import_torchtitan()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", world_size=1, rank=0)
    s = shape_of(a)
    if not bt.tt_version().startswith("0.2"):
        raise SystemExit(f"torchtitan {bt.tt_version()}: this bench builds 0.2.2's model (SDPA; 0.3.0's is flex)")
    model = bt.build_022(s, a.seq_len, torch.device("cpu"))
    bt.check_same_shape(model, s)
    recipe = argparse.Namespace(fp8=False, offload=False, ac=a.ac, compile=compiled, reshard_after_forward="never")
    bt.apply_recipe(model, recipe, bf16=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    loss_fn = torch.compile(ce) if compiled else ce
    ids = torch.randint(0, s.vocab_size, (a.micro_batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ran = f"peer: torchtitan {bt.tt_version()} Llama 3 (SDPA causal), FSDP2 bf16/fp32-reduce 1 rank, whole logits"
    return step, model, ran


def census(a: argparse.Namespace, side: str, compiled: bool) -> tuple[GemmCensus, str, float]:
    """One side's census step (after a compiling warm-up step when compiled); seconds of the census step."""
    step, model, ran = (meshforge_step if side == "meshforge" else peer_step)(a, compiled)
    n = sum(p.numel() for p in model.parameters())  # (a tied weight once; DTensors count whole)
    if n != flops.num_params(shape_of(a)):
        raise SystemExit(f"{side}'s model has {n:,} parameters, the shape {flops.num_params(shape_of(a)):,}")
    dims = ModelDims.of_model(model, shape_of(a).vocab_size, [a.micro_batch * a.seq_len])
    if compiled:
        step()
    c = GemmCensus(dims)
    t0 = time.perf_counter()
    with c:
        step()
    seconds = time.perf_counter() - t0
    del step, model
    gc.collect()
    return c, ran, seconds


def _g(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def kinds_table(exp: dict[str, float], mf: GemmCensus, peer: GemmCensus) -> list[str]:
    """Per kind: expected (models/flops.py), meshforge, peer, meshforge - peer, in GFLOP."""
    out = ["| kind | expected | meshforge | peer | meshforge - peer |", "|---|---|---|---|---|"]
    tm, tp = mf.totals(), peer.totals()
    for name, kinds in GROUPS.items():
        e, m, p = (sum(d[k] for k in kinds) for d in (exp, tm, tp))
        out.append(f"| {name} | {_g(e)} | {_g(m)} | {_g(p)} | {_g(m - p)} |")
        if "attention" in kinds[-1]:
            e, m, p = (d[kinds[-1]] for d in (exp, tm, tp))
            out.append(f"| - of which attention core | {_g(e)} | {_g(m)} | {_g(p)} | {_g(m - p)} |")
    e, m, p = sum(exp.values()), sum(tm.values()), sum(tp.values())
    out.append(f"| **total** | {_g(e)} | {_g(m)} | {_g(p)} | {_g(m - p)} |")
    return out


def gemm_rows(c: GemmCensus, limit: int) -> list[str]:
    """The distinct GEMMs of one census: calls, GFLOP, kind, op, dims, dtypes, layouts, notes."""
    head = "| calls | GFLOP | kind | op | (batch, m, k, n) or attention (b, hq, hkv, sq, sk, d) | dtypes |"
    out = [head + " layout a x b | notes |", "|---|---|---|---|---|---|---|---|"]
    for (kind, op, dims, dtypes, layout, notes), calls, fl in c.rows()[:limit]:
        out.append(f"| {calls} | {_g(fl)} | {kind} | {op} | {dims} | {dtypes} | {layout} | {'; '.join(notes)} |")
    return out


def differences(mf: GemmCensus, peer: GemmCensus) -> list[str]:
    """GEMM signatures (kind, dims, dtypes, layout, notes; op names aside) one side runs and the other does not."""

    def sig(c: GemmCensus) -> dict[tuple, int]:
        acc: dict[tuple, int] = {}
        for (kind, _op, dims, dtypes, layout, notes), calls, _f in c.rows():
            acc[(kind, dims, dtypes, layout, notes)] = acc.get((kind, dims, dtypes, layout, notes), 0) + calls
        return acc

    sm, sp = sig(mf), sig(peer)
    out = []
    for who, mine, other in (("meshforge only", sm, sp), ("peer only", sp, sm)):
        for k, n in mine.items():
            if other.get(k) != n:
                notes = f" ({'; '.join(k[4])})" if k[4] else ""
                out.append(f"- {who}: {n} x {k[0]} {k[1]} {k[2]}, layout {k[3]}{notes}")
    return out or ["- none: the same GEMMs, shapes, dtypes and layouts"]


def explain(side: str, c: GemmCensus, exp: dict[str, float], model_flops: float) -> str:
    """The side's GEMM FLOPs beyond the model count, and whether the expected kinds account for them."""
    t = c.totals()
    total, beyond = sum(t.values()), sum(t.values()) - model_flops
    unseen = f" (higher-order ops run unseen inside: {', '.join(sorted(c.unseen))})" if c.unseen else ""
    off = {k: t[k] - exp[k] for k in KINDS if abs(t[k] - exp[k]) > 1e-6 * max(exp[k], 1.0)}
    why = "recomputation the config asks for" if beyond > 0 and not off else "nothing beyond it"
    if off:
        why = "UNEXPLAINED: " + ", ".join(f"{k} {_g(v)} GFLOP off" for k, v in off.items())
    return f"- {side}: {_g(total)} GFLOP = 6N·T + attention ({_g(model_flops)}) + {_g(beyond)}: {why}{unseen}"


def _head(c: GemmCensus, part: str) -> list[Any]:
    return [r for r in c.records if r.kind == "head" and f"head {part}" in r.notes]


def readings(a: argparse.Namespace, mf: GemmCensus, peer: GemmCensus) -> list[str]:
    """What the differences mean, said only where this run shows them."""
    out = []
    chunks, whole = _head(mf, "forward"), _head(peer, "forward")
    if len(chunks) > len(whole):
        rows = ", ".join(str(r.dims[1]) for r in chunks)
        out.append(
            f"- head: meshforge runs {len(chunks)} GEMM triples of {rows} token rows (the chunked loss, one chunk's "
            f"logits alive at a time) where the peer runs {len(whole)} whole-logits triple: the same 6VH·T FLOPs. "
            "The chunked loss takes the head's input and weight gradients in its forward, from each chunk's softmax; "
            "its backward only scales them, so no head GEMM runs in backward and none twice."
        )
    if any("output add_ into fp32" in r.notes for r in _head(mf, "weight grad")):
        out.append(
            "- head weight gradient: per chunk a bf16 (vocab x hidden) GEMM output is added into an fp32 "
            "accumulator (add_): no FLOPs beyond the count, but one bf16 V x H temporary written and read per chunk "
            "and the sum rounded to bf16 per chunk; the peer's one GEMM sums over all tokens inside the kernel and "
            "rounds once. One call would do it on CUDA (torch.mm(..., out_dtype=torch.float32) or addmm into the "
            "fp32 accumulator); this CPU build has no kernel for either (aten::mm.dtype), so it is not changed here."
        )
    if a.ac == "full":
        out.append(
            "- recomputation (AC full, both sides): each block's forward GEMMs run again in backward except the "
            "last one (w2), whose output backward never reads: torch's checkpoint stops recomputing once backward "
            "has what it needs, and the compiler's partitioner recomputes only what backward reads; the attention "
            "core's forward runs again. models/flops.py's HFU convention counts all of it plus the head."
        )
    return out


def report_mode(a: argparse.Namespace, mode: str) -> float:
    """Both sides' census in one mode, printed; returns meshforge / peer GEMM FLOPs."""
    compiled = mode == "compiled"
    mf, mf_ran, mf_s = census(a, "meshforge", compiled)
    peer, peer_ran, peer_s = census(a, "peer", compiled)
    s, tokens = shape_of(a), a.micro_batch * a.seq_len
    exp = expected_flops(s, tokens, a.seq_len, a.ac)
    model = flops.model_flops_per_token(s, a.seq_len) * tokens
    print(f"\n## {mode}\n\n{mf_ran} ({mf_s:.1f} s); {peer_ran} ({peer_s:.1f} s)\n")
    print("\n".join(kinds_table(exp, mf, peer)))
    print("\nBeyond the model's 6N·T + attention:")
    print(explain("meshforge", mf, exp, model))
    print(explain("peer", peer, exp, model))
    print("\nShape, dtype and layout differences:")
    print("\n".join(differences(mf, peer) + readings(a, mf, peer)))
    for side, c in (("meshforge", mf), ("peer", peer)):
        print(f"\nDistinct GEMMs, {side}, {mode}:\n")
        print("\n".join(gemm_rows(c, a.rows)))
    return sum(mf.totals().values()) / sum(peer.totals().values())


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    s = shape_of(a)
    tokens = a.micro_batch * a.seq_len
    print(f"# GEMM census of one training step ({torch.__version__}, {torch.get_num_threads()} threads)\n")
    print(f"llama3.2-1b shape: hidden {s.hidden}, {s.layers} layers, heads {s.heads}/{s.kv_heads}, ffn {s.ffn_hidden},")
    print(f"vocab {s.vocab_size} (tied); micro-batch {a.micro_batch} x seq {a.seq_len} = {tokens:,} tokens; AC {a.ac}.")
    print("GFLOP per step; expected = models/flops.py (blocks 2N·T per pass, head 6VH·T, attention full square).")
    modes = [m for m in ("eager", "compiled") if m in a.modes.split(",")]
    ratios = {m: report_mode(a, m) for m in modes}
    compiled, eager = (ratios.get(m, float("nan")) for m in ("compiled", "eager"))
    print(f"\nGEMM FLOPs per step, meshforge/peer: compiled {compiled:.4f}, eager {eager:.4f}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
